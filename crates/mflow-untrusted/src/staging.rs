//! The staging directory an output directory is written in, so that the output appears whole or
//! not at all: `.<name>.staging-<pid>` beside the destination (the final rename stays on one file
//! system, so it is atomic), renamed onto the destination by [`Staging::commit`] and removed when
//! it is dropped before that. The native commands (`mflow model`, `convert`, `export`, `dataset`)
//! and `mflow output --download` write through it, on their own or as a stage.
//!
//! A process that is asked to stop (SIGINT, SIGTERM) removes its own: its signal handler calls
//! [`remove_all`] before it exits, and from then on nothing is created or committed here. A
//! process that is killed (SIGKILL, a power cut) cannot: the next one to write the same
//! destination removes what it left ([`sweep`]). What the sweep removes is someone else's, so it
//! removes only what is exactly that: a directory (a link is never followed nor removed) whose
//! name is the destination's staging name with the pid of a process that no longer exists, and
//! that no process holds. The owner holds an advisory lock (flock) on its staging directory for
//! as long as it lives, which keeps the staging of a process in another pid namespace that
//! shares the disk (another container, another host) from being taken for a dead one's.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// What comes between `.<name>` and the pid in a staging directory's name.
const MARK: &str = ".staging-";

/// A staging directory that could not be made, committed or removed: the path, and why.
#[derive(Debug)]
pub struct StagingError {
    pub path: PathBuf,
    pub source: io::Error,
}

impl std::fmt::Display for StagingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.source)
    }
}

impl std::error::Error for StagingError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

fn failed(path: &Path) -> impl FnOnce(io::Error) -> StagingError + '_ {
    move |source| StagingError { path: path.to_path_buf(), source }
}

/// A directory beside the destination that becomes the destination on [`Staging::commit`], and
/// is removed if it is dropped before that.
pub struct Staging {
    dir: PathBuf,
    dest: PathBuf,
    /// The flock that says the directory's owner is alive; released when the process ends.
    _lock: Option<File>,
    committed: bool,
}

impl Staging {
    /// Creates `.<name>.staging-<pid>` beside `dest` (and `dest`'s parents), after removing the
    /// staging directories of `dest` that dead processes left ([`sweep`]). What is at `dest` is
    /// the caller's to check; it is not touched before [`Staging::commit`].
    pub fn create(dest: &Path) -> Result<Staging, StagingError> {
        let no_name = || io::Error::new(io::ErrorKind::InvalidInput, "the path has no file name");
        let name = dest.file_name().ok_or_else(|| failed(dest)(no_name()))?;
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent).map_err(failed(&parent))?;
        sweep(&parent, name);
        let dir = parent.join(staging_name(name, std::process::id()));
        let mut live = live();
        if live.closed {
            return Err(failed(&dir)(stopping()));
        }
        if std::fs::symlink_metadata(&dir).is_ok() {
            // Left by an earlier process that had this pid and was killed, unless someone holds it.
            if held(&dir) {
                return Err(failed(&dir)(io::Error::new(io::ErrorKind::AlreadyExists, "in use by another process")));
            }
            remove(&dir).map_err(failed(&dir))?;
        }
        std::fs::create_dir(&dir).map_err(failed(&dir))?;
        let lock = lock(&dir);
        live.dirs.push(dir.clone());
        Ok(Staging { dir, dest: dest.to_path_buf(), _lock: lock, committed: false })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Renames the staging directory onto the destination, in one step: rename(2) replaces an
    /// empty directory there (one made for the output by the engine) and refuses anything else,
    /// which stays as it was.
    pub fn commit(mut self) -> Result<(), StagingError> {
        let mut live = live();
        if live.closed {
            return Err(failed(&self.dir)(stopping()));
        }
        std::fs::rename(&self.dir, &self.dest).map_err(failed(&self.dest))?;
        self.committed = true;
        live.forget(&self.dir);
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        let mut live = live();
        // Not when a signal's handler removed it already.
        if live.forget(&self.dir) {
            let _ = remove(&self.dir);
        }
    }
}

/// What stands at an output's destination and keeps the output from going there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Taken {
    /// A symbolic link, whatever it points to: rename(2) would refuse it after all the writing
    /// (or replace it), and never write into its target.
    Link,
    /// A file or the like, or a directory with something in it.
    NotEmpty,
}

/// What keeps `dest` from taking an output, if anything: an output goes only where nothing is,
/// or in place of an empty directory (one the engine made for it). The error is reading `dest`.
pub fn taken(dest: &Path) -> io::Result<Option<Taken>> {
    match std::fs::symlink_metadata(dest) {
        Err(_) => Ok(None),
        Ok(m) if m.file_type().is_symlink() => Ok(Some(Taken::Link)),
        Ok(m) if m.is_dir() => Ok(std::fs::read_dir(dest)?.next().is_some().then_some(Taken::NotEmpty)),
        Ok(_) => Ok(Some(Taken::NotEmpty)),
    }
}

/// Creates the directory `root/rel` and those between, as `create_dir_all` does, but never
/// `root` itself: a staging directory that a signal's handler removed is not made again by a
/// thread still writing in it. `rel` is relative and stays below `root`.
pub fn create_dir_below(root: &Path, rel: &Path) -> io::Result<()> {
    let mut dir = root.to_path_buf();
    for c in rel.components() {
        match c {
            std::path::Component::Normal(n) => dir.push(n),
            std::path::Component::CurDir => continue,
            _ => return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a path below the directory")),
        }
        match std::fs::create_dir(&dir) {
            Err(e) if e.kind() != io::ErrorKind::AlreadyExists || !dir.symlink_metadata().is_ok_and(|m| m.is_dir()) => {
                return Err(e)
            }
            _ => {}
        }
    }
    Ok(())
}

/// `.<name>.staging-<pid>`: the staging directory's name of destination `name` for process `pid`.
pub fn staging_name(name: &OsStr, pid: u32) -> OsString {
    let mut s = OsString::from(".");
    s.push(name);
    s.push(format!("{MARK}{pid}"));
    s
}

/// The pid in `entry` when it is exactly a staging directory's name of destination `name`.
fn owner(entry: &OsStr, name: &OsStr) -> Option<u32> {
    let digits = entry.as_bytes().strip_prefix(b".")?.strip_prefix(name.as_bytes())?.strip_prefix(MARK.as_bytes())?;
    if digits.first().is_none_or(|d| *d == b'0') || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let pid: u32 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    (pid <= i32::MAX as u32).then_some(pid)
}

/// Removes the staging directories of destination `name` in `parent` that processes which no
/// longer exist left behind; returns how many it removed. Anything else stays: another name, a
/// file or a link with that name, the staging of this process or of a live one, or one whose
/// lock is held.
pub fn sweep(parent: &Path, name: &OsStr) -> usize {
    let Ok(entries) = std::fs::read_dir(parent) else { return 0 };
    let mut removed = 0;
    for e in entries.flatten() {
        let Some(pid) = owner(&e.file_name(), name) else { continue };
        if pid == std::process::id() || alive(pid) {
            continue;
        }
        let path = e.path();
        let is_dir = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir());
        // remove_dir_all removes a link put in the directory's place since, never its target.
        if is_dir && !held(&path) && std::fs::remove_dir_all(&path).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Removes every staging directory of this process that is not committed, and lets none be
/// created or committed after: for a signal's handler, right before the process exits. Threads
/// may still be writing in them; returns those removed.
pub fn remove_all() -> Vec<PathBuf> {
    let mut live = live();
    live.closed = true;
    let dirs = std::mem::take(&mut live.dirs);
    for dir in &dirs {
        // A file created while the tree is removed makes the last rmdir fail: again, briefly.
        // Once the directory is gone, nothing can be created in it.
        for _ in 0..100 {
            match remove(dir) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    std::thread::sleep(std::time::Duration::from_millis(5))
                }
                _ => break,
            }
        }
    }
    dirs
}

/// The staging directories of this process that are neither committed nor removed.
struct Live {
    dirs: Vec<PathBuf>,
    /// Set by [`remove_all`]: the process is stopping.
    closed: bool,
}

impl Live {
    /// Takes `dir` off the list; whether it was on it.
    fn forget(&mut self, dir: &Path) -> bool {
        let at = self.dirs.iter().position(|d| d == dir);
        at.map(|i| self.dirs.swap_remove(i)).is_some()
    }
}

static LIVE: Mutex<Live> = Mutex::new(Live { dirs: Vec::new(), closed: false });

fn live() -> MutexGuard<'static, Live> {
    LIVE.lock().unwrap_or_else(PoisonError::into_inner)
}

fn stopping() -> io::Error {
    io::Error::other("the process is stopping on a signal")
}

/// Removes a directory tree, or a file or link in its place (the link itself, not its target).
fn remove(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) => Err(e),
    }
}

/// Whether a process with this pid exists (a zombie included; one of another user's too).
fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 sends nothing; kill(2) only says whether the process exists.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// The directory itself, never through a link.
fn open_dir(dir: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW).open(dir)
}

fn try_flock(f: &File) -> io::Result<()> {
    // SAFETY: flock(2) on a descriptor the caller owns; nothing else is touched.
    match unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// The owner's lock on its staging directory; none where the file system has no flock.
fn lock(dir: &Path) -> Option<File> {
    let f = open_dir(dir).ok()?;
    try_flock(&f).ok().map(|()| f)
}

/// Whether a live process holds the lock of the directory `dir`.
fn held(dir: &Path) -> bool {
    open_dir(dir).is_ok_and(|f| try_flock(&f).is_err_and(|e| e.raw_os_error() == Some(libc::EWOULDBLOCK)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pid that no process has: a child that ended and was reaped.
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(!alive(pid));
        pid
    }

    fn stale(parent: &Path, name: &str, pid: u32) -> PathBuf {
        let dir = parent.join(staging_name(OsStr::new(name), pid));
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("train.bin"), b"half").unwrap();
        dir
    }

    #[test]
    fn the_sweep_removes_only_a_dead_processes_staging_of_the_destination() {
        let tmp = tempfile::tempdir().unwrap();
        let parent = tmp.path();
        let dead = dead_pid();
        let mut sleeper = std::process::Command::new("sleep").arg("30").spawn().unwrap();

        let gone = stale(parent, "out", dead);
        let of_live = stale(parent, "out", sleeper.id());
        let own = stale(parent, "out", std::process::id());
        let other_destination = stale(parent, "other", dead);
        // Names that are not exactly a staging name of `out`.
        let near: Vec<PathBuf> =
            [format!(".out.staging-{dead}x"), format!(".out.staging-0{dead}"), format!("out.staging-{dead}")]
                .iter()
                .map(|n| parent.join(n))
                .collect();
        for n in &near {
            std::fs::create_dir(n).unwrap();
        }
        // A file by the name, and a link by the name to a directory with something in it.
        let file = parent.join(staging_name(OsStr::new("out"), dead_pid()));
        std::fs::write(&file, b"not a directory").unwrap();
        let target = parent.join("precious");
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("weights"), b"keep").unwrap();
        let link = parent.join(staging_name(OsStr::new("out"), dead_pid()));
        std::os::unix::fs::symlink(&target, &link).unwrap();
        // A dead pid here, but someone holds it (a process in another pid namespace).
        let locked = stale(parent, "out", dead_pid());
        let holder = lock(&locked).unwrap();

        assert_eq!(sweep(parent, OsStr::new("out")), 1);
        assert!(!gone.exists(), "a dead process's staging goes");
        for kept in [&of_live, &own, &other_destination, &file, &locked].into_iter().chain(&near) {
            assert!(kept.symlink_metadata().is_ok(), "{} was removed", kept.display());
        }
        assert!(link.symlink_metadata().unwrap().file_type().is_symlink(), "the link stays");
        assert_eq!(std::fs::read(target.join("weights")).unwrap(), b"keep", "the link is not followed");

        drop(holder);
        assert_eq!(sweep(parent, OsStr::new("out")), 1, "released, it goes");
        assert!(!locked.exists());
        let _ = sleeper.kill();
        let _ = sleeper.wait();
        assert_eq!(sweep(parent, OsStr::new("out")), 1, "its process ended, it goes");
        assert!(!of_live.exists() && own.exists());
    }

    #[test]
    fn a_link_at_the_destination_is_taken_even_to_an_empty_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let (empty, full, file) = (tmp.path().join("empty"), tmp.path().join("full"), tmp.path().join("file"));
        std::fs::create_dir(&empty).unwrap();
        std::fs::create_dir(&full).unwrap();
        std::fs::write(full.join("a"), b"1").unwrap();
        std::fs::write(&file, b"1").unwrap();
        for (name, target) in [("to-empty", &empty), ("to-full", &full), ("dangling", &tmp.path().join("none"))] {
            std::os::unix::fs::symlink(target, tmp.path().join(name)).unwrap();
            assert_eq!(taken(&tmp.path().join(name)).unwrap(), Some(Taken::Link), "{name}");
        }
        assert_eq!(taken(&empty).unwrap(), None);
        assert_eq!(taken(&tmp.path().join("none")).unwrap(), None);
        assert_eq!(taken(&full).unwrap(), Some(Taken::NotEmpty));
        assert_eq!(taken(&file).unwrap(), Some(Taken::NotEmpty));
    }

    #[test]
    fn a_staging_is_committed_whole_or_removed_and_sweeps_what_the_killed_left() {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("nested").join("out");
        std::fs::create_dir_all(tmp.path().join("nested")).unwrap();
        let left = stale(&tmp.path().join("nested"), "out", dead_pid());

        let s = Staging::create(&dest).unwrap();
        assert!(!left.exists(), "a killed process's staging of the destination goes");
        assert_eq!(s.path().parent(), dest.parent(), "beside the destination: the rename is atomic");
        assert!(held(s.path()), "its owner holds it");
        std::fs::write(s.path().join("a"), b"1").unwrap();
        drop(s);
        let names = |d: &Path| std::fs::read_dir(d).unwrap().count();
        assert_eq!(names(&tmp.path().join("nested")), 0, "dropped before commit, it is removed");

        // An empty directory at the destination is replaced; one with something in it is not touched.
        std::fs::create_dir(&dest).unwrap();
        let s = Staging::create(&dest).unwrap();
        std::fs::write(s.path().join("a"), b"1").unwrap();
        s.commit().unwrap();
        assert_eq!(std::fs::read(dest.join("a")).unwrap(), b"1");
        let s = Staging::create(&dest).unwrap();
        std::fs::write(s.path().join("a"), b"2").unwrap();
        assert!(s.commit().is_err());
        assert_eq!(std::fs::read(dest.join("a")).unwrap(), b"1", "the committed output stays");
        assert_eq!(names(&tmp.path().join("nested")), 1, "and the refused staging is removed");
    }
}
