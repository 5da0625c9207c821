//! Opening files that someone else wrote: a stage writing about itself, a model directory from
//! a download, a run record on a shared disk, a git repository.
//!
//! Every such file is opened the same way. The open does not block (O_NONBLOCK: a FIFO in a
//! file's place returns at once instead of waiting for a writer), the type is checked on the
//! opened descriptor (so nothing can be swapped in between check and read) and only a regular
//! file is read; whole-file reads stop at a cap given by the caller (a link to /dev/zero or a
//! huge sparse file is refused by its size, not read into memory); and messages quote at most
//! an excerpt of anything read. These calls block the calling thread on disk I/O: async code
//! calls them through `spawn_blocking`.
//!
//! What a file's sizes make mflow allocate is bounded too, by one memory budget for the whole
//! process ([`budget`]), asked before the allocation with the document's measured shape
//! ([`json`]).
//!
//! What a killed process left beside an output is someone else's file too: the staging directory
//! an output is written in, and the sweep of those that dead processes left, are here
//! ([`staging`]), one copy for every command that writes an output directory.
//!
//! The crate depends on nothing of mflow's, so that every crate of the workspace and the fuzz
//! targets use this one copy.

pub mod budget;
#[cfg(any(test, feature = "counting"))]
pub mod counting;
pub mod git;
pub mod json;
pub mod staging;
pub mod walk;

use std::fs::{File, FileType, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Why a file was not read. It travels inside an [`io::Error`] ([`refusal`] finds it), so that
/// callers that speak `io::Result` keep doing so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Something other than a regular file is there: a FIFO, a device, a directory, a link
    /// where links are refused.
    NotRegular { kind: &'static str },
    /// The file is larger than the caller reads (or grew past it while read).
    TooLarge { size: u64, limit: u64 },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::NotRegular { kind } => write!(f, "it is {kind}, not a regular file"),
            Refusal::TooLarge { size, limit } => write!(f, "it is {size} bytes, more than the {limit} mflow reads"),
        }
    }
}

impl std::error::Error for Refusal {}

impl From<Refusal> for io::Error {
    fn from(r: Refusal) -> io::Error {
        let kind = match r {
            Refusal::NotRegular { .. } => io::ErrorKind::InvalidInput,
            Refusal::TooLarge { .. } => io::ErrorKind::InvalidData,
        };
        io::Error::new(kind, r)
    }
}

/// The refusal inside `e`, when `e` is one.
pub fn refusal(e: &io::Error) -> Option<&Refusal> {
    e.get_ref().and_then(|inner| inner.downcast_ref::<Refusal>())
}

/// A file type in words, with its article: "a FIFO", "a character device".
pub fn kind(ft: FileType) -> &'static str {
    if ft.is_dir() {
        "a directory"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_file() {
        "a regular file"
    } else {
        "a special file"
    }
}

/// The error for a file of type `ft` where a regular file was expected.
pub fn not_regular(ft: FileType) -> io::Error {
    Refusal::NotRegular { kind: kind(ft) }.into()
}

/// Whether the last component of a path may be a symbolic link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Links {
    /// Followed: a file a user named, which may well be a link.
    Follow,
    /// Refused: a file mflow keeps for itself, where a link would have it read or write
    /// somewhere else.
    Refuse,
}

/// Opens `path` with `opts` when it is a regular file (or absent, and `opts` creates it).
pub fn open_with(path: &Path, opts: &mut OpenOptions, links: Links) -> io::Result<File> {
    let mut flags = libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY;
    // Checked first: opening a device can do something (a watchdog starts counting), and
    // opening a directory for writing says only EISDIR. The descriptor is checked again below.
    let first = match links {
        Links::Refuse => {
            flags |= libc::O_NOFOLLOW;
            std::fs::symlink_metadata(path)
        }
        Links::Follow => std::fs::metadata(path),
    };
    if let Ok(m) = first {
        if !m.file_type().is_file() {
            return Err(not_regular(m.file_type()));
        }
    }
    let file = opts.custom_flags(flags).open(path).map_err(|e| match e.raw_os_error() {
        Some(libc::ELOOP) if links == Links::Refuse => Refusal::NotRegular { kind: "a symbolic link" }.into(),
        // A FIFO opened for writing without a reader, or a socket.
        Some(libc::ENXIO) => match std::fs::metadata(path) {
            Ok(m) => not_regular(m.file_type()),
            Err(_) => e,
        },
        _ => e,
    })?;
    let ft = file.metadata()?.file_type();
    if !ft.is_file() {
        return Err(not_regular(ft));
    }
    Ok(file)
}

/// Opens `path` for reading when it is a regular file, following a link to one.
pub fn open_regular(path: &Path) -> io::Result<File> {
    open_with(path, OpenOptions::new().read(true), Links::Follow)
}

/// Reads the whole of an opened file of at most `limit` bytes.
pub fn read_file(file: File, limit: u64) -> io::Result<Vec<u8>> {
    let size = file.metadata()?.len();
    if size > limit {
        return Err(Refusal::TooLarge { size, limit }.into());
    }
    let mut buf = Vec::with_capacity(size as usize);
    // `take` guards against a file that grows while it is read.
    file.take(limit + 1).read_to_end(&mut buf)?;
    if buf.len() as u64 > limit {
        return Err(Refusal::TooLarge { size: buf.len() as u64, limit }.into());
    }
    Ok(buf)
}

/// Reads the whole of `path`, a regular file (a link to one is followed) of at most `limit`
/// bytes.
pub fn read_bounded(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    read_file(open_regular(path)?, limit)
}

/// [`read_bounded`] refusing a link in the last component: for files mflow keeps for itself.
pub fn read_bounded_nofollow(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    read_file(open_with(path, OpenOptions::new().read(true), Links::Refuse)?, limit)
}

/// [`read_bounded`] as UTF-8 text.
pub fn read_text(path: &Path, limit: u64) -> io::Result<String> {
    String::from_utf8(read_bounded(path, limit)?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "it is not UTF-8 text"))
}

/// At most `max` bytes of the regular file `path` from byte `offset` on, and the file's size
/// when opened: for following a file that another process appends to, a piece at a time.
pub fn read_from(path: &Path, offset: u64, max: u64) -> io::Result<(Vec<u8>, u64)> {
    let mut file = open_regular(path)?;
    let size = file.metadata()?.len();
    if offset >= size {
        return Ok((Vec::new(), size));
    }
    file.seek(SeekFrom::Start(offset))?;
    let want = (size - offset).min(max);
    let mut buf = Vec::with_capacity(want as usize);
    file.take(want).read_to_end(&mut buf)?;
    Ok((buf, size))
}

/// Copies the regular file `path` to `to` from byte `offset` on, as it is when opened (a file
/// that grows meanwhile is copied up to its size then); returns the bytes copied. For files
/// too large to hold in memory that are read only to be passed on (a stage's log).
pub fn copy_from(path: &Path, offset: u64, to: &mut dyn io::Write) -> io::Result<u64> {
    let mut file = open_regular(path)?;
    let size = file.metadata()?.len();
    if offset >= size {
        return Ok(0);
    }
    file.seek(SeekFrom::Start(offset))?;
    io::copy(&mut file.take(size - offset), to)
}

/// `dir/name` if it exists and resolves (through any links) to a regular file inside `dir`;
/// `None` if nothing is there; an error naming the target if it leads outside `dir`, or if it
/// is not a regular file.
pub fn resolve_inside(dir: &Path, name: &str) -> io::Result<Option<PathBuf>> {
    let path = dir.join(name);
    match std::fs::symlink_metadata(&path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
        Ok(_) => {}
    }
    let root = dir.canonicalize()?;
    let target = path.canonicalize()?;
    if !target.starts_with(&root) {
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, Escapes { target, dir: root }));
    }
    let meta = std::fs::metadata(&target)?;
    if !meta.is_file() {
        return Err(not_regular(meta.file_type()));
    }
    Ok(Some(target))
}

/// A link that leads out of the directory it was found in (inside an [`io::Error`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Escapes {
    pub target: PathBuf,
    pub dir: PathBuf,
}

impl std::fmt::Display for Escapes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "resolves to {}, outside {}; replace the link with a copy of the file",
            self.target.display(),
            self.dir.display()
        )
    }
}

impl std::error::Error for Escapes {}

/// Longest excerpt of file content quoted in a message, in characters.
pub const EXCERPT_CHARS: usize = 200;

/// At most [`EXCERPT_CHARS`] characters of `s`, marking what was cut, for quoting file content
/// in messages.
pub fn excerpt(s: &str) -> String {
    excerpt_of(&s)
}

/// [`excerpt`] of a value's display form, without formatting more of it than is quoted.
pub fn excerpt_of(v: &dyn std::fmt::Display) -> String {
    use std::fmt::Write;
    // Keeps the first bytes written and counts the rest.
    struct Cap {
        out: String,
        total: usize,
    }
    impl Write for Cap {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            self.total += s.len();
            let mut end = (EXCERPT_CHARS * 4).saturating_sub(self.out.len()).min(s.len());
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            self.out.push_str(&s[..end]);
            Ok(())
        }
    }
    let mut cap = Cap { out: String::new(), total: 0 };
    let _ = write!(cap, "{v}");
    let cut = cap.out.char_indices().nth(EXCERPT_CHARS).map(|(i, _)| i);
    match cut {
        None if cap.total == cap.out.len() => cap.out,
        None => format!("{}... ({} bytes in all)", cap.out, cap.total),
        Some(i) => format!("{}... ({} bytes in all)", &cap.out[..i], cap.total),
    }
}

#[cfg(test)]
mod tests;
