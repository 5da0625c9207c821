//! Which directories may be a workdir. mflow creates, rewrites and removes files in its workdir,
//! so it uses only a directory it owns: one it created (which holds the marker
//! `.mflow-workdir`), an empty one (it writes the marker there first), or one with the layout
//! of an older mflow (`cache/.manifests.jsonl`, `cache/.lock`, `runs/`, or the files of
//! `state/`), which it adopts by writing the marker. Never `/`, a system directory or the home directory itself.

use std::ffi::OsStr;
use std::fs;
use std::io::{self, Write};
use std::path::{Component, Path, PathBuf};

use crate::cache::{io_err, CacheError};

use super::{Workdir, OLDER_LAYOUT, WRITTEN};

/// The file that marks a directory as mflow's workdir.
pub const MARKER: &str = ".mflow-workdir";

const MARKER_TEXT: &str = "This directory is an mflow workdir: the cache, run records and state of mflow, which creates,\nrewrites and removes files here. `mflow gc` and `mflow cache repair` maintain it.\n";

/// What a directory is, seen as a workdir.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// Nothing there yet: mflow creates it, with its marker, when it first writes.
    Missing,
    Empty,
    Marked,
    /// The layout of a workdir of an older mflow, without the marker.
    Unmarked,
}

impl Found {
    /// Holds mflow's files (something for `gc` or `cache repair` to look at).
    pub fn is_workdir(self) -> bool {
        matches!(self, Found::Marked | Found::Unmarked)
    }
}

/// Why a directory cannot be a workdir, and what to do about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub reason: String,
    pub help: String,
}

const USE_ANOTHER: &str = "point `workdir` (or --workdir) at a directory of its own for mflow, e.g. `.mflow` beside the spec; mflow creates it";

/// Says whether `path` may be a workdir, and what is there. Reads only.
pub fn inspect(path: &Path) -> Result<Found, Refusal> {
    let real = resolve(path);
    if let Some(what) = system_dir(&real) {
        return Err(Refusal { reason: format!("{} is {what}", real.display()), help: USE_ANOTHER.into() });
    }
    let meta = match fs::metadata(&real) {
        Ok(m) => m,
        // ENOTDIR: a file is in the way further up; creating the workdir reports it.
        Err(e) if e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ENOTDIR) => {
            return Ok(Found::Missing)
        }
        Err(e) => {
            return Err(Refusal {
                reason: format!("{} cannot be read: {e}", real.display()),
                help: "check its permissions".into(),
            })
        }
    };
    if !meta.is_dir() {
        return Err(Refusal {
            reason: format!("{} is {}, not a directory", real.display(), crate::cache::files::kind(meta.file_type())),
            help: USE_ANOTHER.into(),
        });
    }
    // mflow writes below these; a link may put one on another disk, but not into the system.
    for sub in WRITTEN {
        if fs::symlink_metadata(real.join(sub)).is_ok_and(|m| m.file_type().is_symlink()) {
            let target = resolve(&real.join(sub));
            if let Some(what) = system_dir(&target) {
                return Err(Refusal {
                    reason: format!("its `{sub}` links to {}, which is {what}", target.display()),
                    help: "remove the link; mflow creates the directory".into(),
                });
            }
        }
    }
    if fs::symlink_metadata(real.join(MARKER)).is_ok_and(|m| m.is_file()) {
        return Ok(Found::Marked);
    }
    let has = |rel: &str| fs::symlink_metadata(real.join(rel)).is_ok();
    if OLDER_LAYOUT.iter().any(|f| has(f)) || fs::metadata(Workdir::new(&real).runs()).is_ok_and(|m| m.is_dir()) {
        return Ok(Found::Unmarked);
    }
    let names: Vec<String> = match fs::read_dir(&real) {
        Ok(rd) => rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).take(4).collect(),
        Err(e) => {
            return Err(Refusal {
                reason: format!("{} cannot be listed: {e}", real.display()),
                help: "check its permissions".into(),
            })
        }
    };
    if names.is_empty() {
        return Ok(Found::Empty);
    }
    let mut shown: Vec<String> = names.iter().take(3).map(|n| format!("`{n}`")).collect();
    if names.len() > 3 {
        shown.push("more".into());
    }
    Err(Refusal {
        reason: format!(
            "{} is not empty and is not an mflow workdir (it holds {}, and no `{MARKER}`)",
            real.display(),
            shown.join(", ")
        ),
        help: format!("{USE_ANOTHER}; a directory that is an mflow workdir holds `{MARKER}`"),
    })
}

/// Makes `path` a workdir for a command that writes there: refuses what `inspect` refuses,
/// creates it when missing, and writes the marker when it lacks one.
pub fn claim(path: &Path) -> Result<(), CacheError> {
    let found = inspect(path).map_err(|r| CacheError::NotWorkdir {
        path: path.to_path_buf(),
        reason: r.reason,
        help: r.help,
    })?;
    match found {
        Found::Marked => Ok(()),
        Found::Missing => {
            fs::create_dir_all(path).map_err(io_err("cannot create the workdir", path))?;
            mark(path)
        }
        Found::Empty | Found::Unmarked => mark(path),
    }
}

fn mark(path: &Path) -> Result<(), CacheError> {
    let marker = Workdir::new(path).marker();
    // Created, never opened: two first runs in one directory may both get here.
    match fs::OpenOptions::new().write(true).create_new(true).open(&marker) {
        Ok(mut f) => f.write_all(MARKER_TEXT.as_bytes()).map_err(io_err("cannot write", &marker)),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io_err("cannot create", &marker)(e)),
    }
}

/// `path` made absolute with the symbolic links and `..` of its existing part resolved, and
/// the rest normalized as written: what the directory really is, whether it exists or not.
pub fn resolve(path: &Path) -> PathBuf {
    let abs =
        if path.is_absolute() { path.to_path_buf() } else { std::env::current_dir().unwrap_or_default().join(path) };
    let mut existing = abs.as_path();
    let mut rest: Vec<&OsStr> = Vec::new();
    let mut base = loop {
        if let Ok(real) = fs::canonicalize(existing) {
            break real;
        }
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name);
                existing = parent;
            }
            // `..` as the last component, or the root: normalized below.
            (Some(parent), None) => {
                rest.push(OsStr::new(".."));
                existing = parent;
            }
            (None, _) => break PathBuf::from("/"),
        }
    };
    for c in rest.into_iter().rev() {
        match Path::new(c).components().next() {
            Some(Component::ParentDir) => {
                base.pop();
            }
            Some(Component::Normal(n)) => base.push(n),
            _ => {}
        }
    }
    base
}

/// What kind of system directory `p` (resolved) is, if it is one.
fn system_dir(p: &Path) -> Option<&'static str> {
    let parts: Vec<&str> = p
        .components()
        .filter_map(|c| if let Component::Normal(n) = c { Some(n.to_str().unwrap_or("")) } else { None })
        .collect();
    let Some(&top) = parts.first() else { return Some("the root directory") };
    // Trees that belong to the system as a whole.
    if matches!(top, "etc" | "bin" | "sbin" | "boot" | "dev" | "proc" | "sys") || top.starts_with("lib") {
        return Some("a system directory");
    }
    // Trees with system directories in them, but room for data further down (`/var/lib/NAME`).
    if matches!(top, "usr" | "var" | "run") && parts.len() <= 2 {
        return Some("a system directory");
    }
    // Shared places whose other contents are not mflow's.
    if parts.len() == 1 && matches!(top, "home" | "root" | "tmp" | "mnt" | "media" | "opt" | "srv") {
        return Some("a system directory");
    }
    let home = std::env::var_os("HOME").filter(|h| !h.is_empty()).map(PathBuf::from);
    if home.is_some_and(|h| fs::canonicalize(&h).unwrap_or(h) == p) {
        return Some("the home directory");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_directories_are_refused_and_data_below_them_is_not() {
        for p in ["/", "/etc", "/etc/mflow", "/usr", "/usr/local", "/var", "/var/lib", "/lib64", "/proc/self", "/tmp"] {
            assert!(system_dir(Path::new(p)).is_some(), "{p}");
        }
        for p in ["/var/lib/mflow", "/usr/src/app/.mflow", "/tmp/x/.mflow", "/mflow", "/data/w"] {
            assert!(system_dir(Path::new(p)).is_none(), "{p}");
        }
    }

    #[test]
    fn a_path_resolves_through_links_and_dots_whether_or_not_it_exists() {
        let tmp = tempfile::tempdir().unwrap();
        let real = fs::canonicalize(tmp.path()).unwrap();
        fs::create_dir(real.join("a")).unwrap();
        std::os::unix::fs::symlink("/etc", real.join("a/up")).unwrap();
        assert_eq!(resolve(&real.join("a/../b/c/..")), real.join("b"));
        assert_eq!(resolve(&real.join("a/up")), PathBuf::from("/etc"));
        assert_eq!(resolve(&real.join("a/../../../../..")), PathBuf::from("/"));
    }

    #[test]
    fn only_an_own_empty_or_older_workdir_is_accepted() {
        let tmp = tempfile::tempdir().unwrap();
        let w = tmp.path().join("w");
        assert_eq!(inspect(&w), Ok(Found::Missing));
        claim(&w).unwrap();
        assert_eq!(inspect(&w), Ok(Found::Marked));
        let foreign = tmp.path().join("f");
        fs::create_dir_all(foreign.join("sub")).unwrap();
        assert!(inspect(&foreign).unwrap_err().reason.contains("`sub`"));
        assert!(claim(&foreign).is_err());
        assert_eq!(fs::read_dir(&foreign).unwrap().count(), 1, "a refused directory was written to");
        fs::create_dir_all(foreign.join("runs")).unwrap();
        assert_eq!(inspect(&foreign), Ok(Found::Unmarked));
        claim(&foreign).unwrap();
        assert_eq!(inspect(&foreign), Ok(Found::Marked));
        std::os::unix::fs::symlink("/etc", foreign.join("cache")).unwrap();
        assert!(inspect(&foreign).unwrap_err().reason.contains("links to /etc"));
        fs::remove_file(foreign.join("cache")).unwrap();
        fs::write(tmp.path().join("file"), "").unwrap();
        assert!(inspect(&tmp.path().join("file")).unwrap_err().reason.contains("not a directory"));
    }
}
