//! Files a user names for mflow to write: `--junit`, `--report`, `mflow report --out` and
//! `--png`, `$GITHUB_STEP_SUMMARY`, `mflow output --download`.
//!
//! Such a path is the user's, so it is written, never replaced: what is there keeps its inode,
//! owner and mode. A regular file is truncated and written in place; a character device
//! (/dev/null) or a FIFO with a reader is written to as it is; a directory, a block device or
//! a socket is refused. A new file is written beside and linked into place, so that it appears
//! whole and nothing that appeared meanwhile is replaced. The files mflow keeps for itself
//! (the spec being run, anything under the workdir or MFLOW_HOME) are refused, naming the
//! path: a report must not overwrite the spec or the cache's manifest log. mflow's own
//! records keep their atomic writes (`record::write_atomic`).

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Component, Path, PathBuf};

use miette::Diagnostic;
use thiserror::Error;

#[derive(Debug, Error, Diagnostic)]
pub enum OutputError {
    #[error("{} is {what}, which mflow keeps for itself; it does not write a report or a download there", path.display())]
    #[diagnostic(
        code(mflow::output::owned),
        help("name a path outside the workdir and MFLOW_HOME, other than the spec")
    )]
    Owned { path: PathBuf, what: String },
    #[error("{} is {kind}; mflow writes there only to a regular file, a FIFO or a character device", path.display())]
    #[diagnostic(code(mflow::output::file_type), help("name a file, or remove what is in its place"))]
    FileType { path: PathBuf, kind: &'static str },
    #[error("cannot write {}", path.display())]
    #[diagnostic(code(mflow::output::io), help("check that the directory exists and is writable"))]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl OutputError {
    /// Whether the path the user named is what failed (it, or a directory on its way, is
    /// missing, not a directory, not writable, or a FIFO nobody reads), not the machine.
    pub fn is_users(&self) -> bool {
        match self {
            OutputError::Owned { .. } | OutputError::FileType { .. } => true,
            OutputError::Io { source, .. } => users_fault(source),
        }
    }
}

/// An error of writing a user-named path that the path itself causes: exit code 2, not 70.
pub fn users_fault(e: &io::Error) -> bool {
    use io::ErrorKind as K;
    matches!(
        e.kind(),
        K::NotFound
            | K::NotADirectory
            | K::IsADirectory
            | K::AlreadyExists
            | K::PermissionDenied
            | K::ReadOnlyFilesystem
            | K::InvalidFilename
    ) || matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENAMETOOLONG | libc::EEXIST | libc::ENOTDIR))
        // The FIFO without a reader (`open_existing`).
        || (e.kind() == K::Other && e.raw_os_error().is_none())
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> OutputError + '_ {
    move |source| OutputError::Io { path: path.to_path_buf(), source }
}

/// What mflow keeps for itself, which no user-named output may be.
#[derive(Debug, Default, Clone)]
pub struct Owned {
    /// Directories, resolved, with what to call them.
    dirs: Vec<(PathBuf, String)>,
    /// Files, resolved, with their identity (a hard link is the same file), and what to call them.
    files: Vec<(PathBuf, Option<FileId>, String)>,
}

/// A file's device and inode.
type FileId = (u64, u64);

impl Owned {
    /// mflow's home (checked specs, Python environments) and `workdir`.
    pub fn new(workdir: &Path) -> Owned {
        let mut o = Owned::default();
        o.dirs.push((resolve(&crate::env::home()), "under MFLOW_HOME".into()));
        o.dirs.push((resolve(workdir), format!("under the workdir {}", workdir.display())));
        o
    }

    /// Also the spec being run.
    pub fn spec(mut self, spec: &Path) -> Owned {
        let id = std::fs::metadata(spec).ok().map(|m| (m.dev(), m.ino()));
        self.files.push((resolve(spec), id, "the spec being run".into()));
        self
    }

    /// Refuses `path` when it is, or resolves to, something mflow keeps.
    pub fn check(&self, path: &Path) -> Result<(), OutputError> {
        let real = resolve(path);
        let id = std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()));
        let owned = |what: &str| Err(OutputError::Owned { path: path.to_path_buf(), what: what.to_string() });
        for (file, file_id, what) in &self.files {
            if *file == real || (id.is_some() && id == *file_id) {
                return owned(what);
            }
        }
        for (dir, what) in &self.dirs {
            if real.starts_with(dir) {
                return owned(what);
            }
        }
        Ok(())
    }
}

/// `path` made absolute with every link resolved, as far as it exists; the rest is appended
/// with `.` and `..` taken lexically.
fn resolve(path: &Path) -> PathBuf {
    let abs =
        if path.is_absolute() { path.to_path_buf() } else { std::env::current_dir().unwrap_or_default().join(path) };
    let mut rest = Vec::new();
    let mut cur = abs.as_path();
    loop {
        if let Ok(real) = std::fs::canonicalize(cur) {
            let mut out = real;
            for c in rest.iter().rev() {
                match c {
                    Component::ParentDir => {
                        out.pop();
                    }
                    Component::Normal(n) => out.push(n),
                    _ => {}
                }
            }
            return out;
        }
        match (cur.parent(), cur.components().next_back()) {
            (Some(parent), Some(last)) => {
                rest.push(last);
                cur = parent;
            }
            _ => return abs,
        }
    }
}

/// Writes `bytes` to the user-named `path` (see the module's comment), after `owned` allows it.
pub fn write(path: &Path, bytes: &[u8], owned: &Owned) -> Result<(), OutputError> {
    owned.check(path)?;
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => create(path, bytes),
        Err(e) => Err(io_err(path)(e)),
        Ok(_) => {
            let mut f = open_existing(path, false, false)?;
            f.write_all(bytes).and_then(|()| f.flush()).map_err(io_err(path))
        }
    }
}

/// Appends `bytes` to the user-named `path`, creating it when absent.
pub fn append(path: &Path, bytes: &[u8], owned: &Owned) -> Result<(), OutputError> {
    owned.check(path)?;
    let mut f = open_existing(path, true, true)?;
    f.write_all(bytes).and_then(|()| f.flush()).map_err(io_err(path))
}

/// Opens what is at `path` for writing in place: never blocks on a FIFO without a reader, and
/// refuses what mflow must not write to.
fn open_existing(path: &Path, append: bool, create: bool) -> Result<File, OutputError> {
    let file = OpenOptions::new()
        .write(true)
        .append(append)
        .create(create)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::EISDIR) => OutputError::FileType { path: path.to_path_buf(), kind: "a directory" },
            Some(libc::ENXIO) => match std::fs::metadata(path) {
                Ok(m) if m.file_type().is_fifo() => {
                    io_err(path)(io::Error::other("it is a FIFO that no process is reading"))
                }
                Ok(m) => OutputError::FileType { path: path.to_path_buf(), kind: mflow_untrusted::kind(m.file_type()) },
                Err(_) => io_err(path)(e),
            },
            _ => io_err(path)(e),
        })?;
    let ft = file.metadata().map_err(io_err(path))?.file_type();
    if ft.is_file() {
        if !append {
            file.set_len(0).map_err(io_err(path))?;
        }
    } else if ft.is_fifo() || ft.is_char_device() {
        // Opened without blocking; written to as any writer would, waiting for the reader.
        // SAFETY: fcntl on a descriptor this function owns.
        let fd = file.as_raw_fd();
        unsafe { libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) & !libc::O_NONBLOCK) };
    } else {
        return Err(OutputError::FileType { path: path.to_path_buf(), kind: mflow_untrusted::kind(ft) });
    }
    Ok(file)
}

/// A new file: written beside, then linked into place, which fails rather than replace what
/// appeared there meanwhile (that is then written in place).
fn create(path: &Path, bytes: &[u8]) -> Result<(), OutputError> {
    let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.mflow-{}-{:08x}", std::process::id(), fastrand::u32(..)));
    let written = OpenOptions::new().write(true).create_new(true).open(&tmp).and_then(|mut f| f.write_all(bytes));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(io_err(path)(e));
    }
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(()),
        // Something appeared, or the filesystem has no hard links: written in place.
        Err(_) => {
            let mut f = open_existing(path, false, true)?;
            f.write_all(bytes).map_err(io_err(path))
        }
    }
}

/// Puts the finished file `staged` (mflow's, beside `path`) at the user-named `path`: linked
/// into place when nothing is there, else copied into what is there; `staged` is removed.
pub fn place(staged: &Path, path: &Path, owned: &Owned) -> Result<(), OutputError> {
    let placed = (|| {
        owned.check(path)?;
        if std::fs::symlink_metadata(path).is_err() && std::fs::hard_link(staged, path).is_ok() {
            return Ok(());
        }
        let mut to = open_existing(path, false, true)?;
        let mut from = File::open(staged).map_err(io_err(staged))?;
        io::copy(&mut from, &mut to).map(drop).map_err(io_err(path))
    })();
    let _ = std::fs::remove_file(staged);
    placed
}

/// Checks a directory mflow is to create for the user (`--download`, `--png`).
pub fn check_dir(path: &Path, owned: &Owned) -> Result<(), OutputError> {
    owned.check(path)
}
