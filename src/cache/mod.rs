//! The content-addressed store. An entry `cache/<key>/` is the stage's output directory; its
//! manifest (every file with its size and digest) is a line of the manifest log. Entries are
//! built in `cache/.staging/` and committed by appending the manifest and then one rename, so
//! a reader sees a whole entry or none.
//!
//! Only the manifest log vouches for an entry. An entry whose manifest proves it damaged is
//! removed; one the log does not know (no line, or no readable log) is never deleted: it is left
//! in place unverified, kept if the stage's rerun produces the same files, else set aside in
//! `cache/.unverified/` (`mflow cache repair` restores what the run records confirm).

mod dir;
mod files;
pub mod key;
mod maintain;
mod manifests;
mod staging;
pub mod workdir;

pub use dir::{FileStat, OpenDir};
pub(crate) use files::read_regular;

/// Largest state file mflow reads back (stat caches, keys, run records, lockfiles).
pub(crate) const MAX_STATE_BYTES: u64 = 1 << 30;
pub use maintain::{gc, repair, GcReport, RepairReport};

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use miette::Diagnostic;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::exit::ExitCode;

#[derive(Debug, Error, Diagnostic)]
pub enum CacheError {
    /// The cause is part of the message: a stage's failure shows only the message.
    #[error("{op} {}: {cause}", path.display())]
    #[diagnostic(code(mflow::cache::io), help("check the permissions of the workdir and the free space on its filesystem"))]
    Io { op: &'static str, path: PathBuf, cause: io::Error },
    #[error("{op} {}: {cause}", path.display())]
    #[diagnostic(code(mflow::cache::not_regular), help("mflow keeps a regular file there: move what is in its place elsewhere"))]
    NotRegular { op: &'static str, path: PathBuf, cause: io::Error },
    #[error("stage output file name {name} is not valid UTF-8 (shown escaped)")]
    #[diagnostic(code(mflow::cache::file_name), help("name output files in UTF-8: the manifest and the lockfile record names as text"))]
    NotUtf8 { name: String },
    #[error("stage output contains {}, which is not a regular file or directory", path.display())]
    #[diagnostic(code(mflow::cache::file_type), help("write plain files and directories under $MFLOW_OUTPUT; copy instead of linking"))]
    FileType { path: PathBuf },
    #[error("the manifest log {} cannot be used: {cause}", path.display())]
    #[diagnostic(
        code(mflow::cache::log),
        help("mflow keeps a regular file there; `mflow cache repair --workdir {}` moves what is in the way aside and rebuilds the log from the entries", workdir.display())
    )]
    Log { path: PathBuf, workdir: PathBuf, cause: io::Error },
    #[error("{} is not a workdir mflow may use: {reason}", path.display())]
    #[diagnostic(code(mflow::cache::not_workdir), help("{help}"))]
    NotWorkdir { path: PathBuf, reason: String, help: String },
    #[error("the cache of {} is in use by a run (or another `mflow gc` or `mflow cache repair`); nothing was changed", workdir.display())]
    #[diagnostic(code(mflow::cache::in_use), help("run it again when the run has ended, or pass --wait to wait for it"))]
    InUse { workdir: PathBuf },
}

impl CacheError {
    /// Refusals are the caller's to fix (2), a busy cache is to be retried (3), the rest is
    /// the environment (70).
    pub fn exit_code(&self) -> ExitCode {
        match self {
            CacheError::NotWorkdir { .. } => ExitCode::Invalid,
            CacheError::InUse { .. } => ExitCode::Infra,
            _ => ExitCode::Internal,
        }
    }
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> CacheError + 'a {
    move |cause| match cause.kind() {
        // What `files::open` and `hash_file` say of a FIFO, a directory or a link in a file's place.
        io::ErrorKind::InvalidInput => CacheError::NotRegular { op, path: path.to_path_buf(), cause },
        _ => CacheError::Io { op, path: path.to_path_buf(), cause },
    }
}

/// The manifest log, relative to the cache.
const LOG: &str = ".manifests.jsonl";
/// The lock file, relative to the cache.
const LOCK: &str = ".lock";
/// The byte of the lock file that every store open for writing holds shared, and that `gc` and
/// `cache repair` take exclusively (see `maintain`). Past every key's byte (`lock_offset`).
const LIVE: libc::off_t = 1 << 62;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    pub path: String,
    pub size: u64,
    pub blake3: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub version: u32,
    pub key: String,
    pub stage: String,
    pub files: Vec<FileEntry>,
    /// Digest of the file list: the output's identity for downstream keys.
    pub digest: String,
}

impl Manifest {
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

#[derive(Debug)]
pub enum Lookup {
    Hit(Arc<Manifest>),
    Miss,
    /// The entry exists but does not check out. One that its manifest proves damaged has been
    /// removed (unless the store is read-only); one without a manifest is left in place.
    Corrupt(String),
}

/// Why an existing entry is not a hit.
enum Failure {
    /// The log does not vouch for it: kept. With what is wrong with the log itself, if anything.
    Unverified(String, Option<String>),
    /// Its manifest says otherwise: removed by a writing store.
    Damaged(String),
}

/// A workdir's manifest log, read without creating anything there, so that a run can read it
/// while its spec loads (`Store::adopt` takes it).
pub struct LogRead(manifests::Log);

impl LogRead {
    pub fn read(workdir: &Path) -> LogRead {
        let mut log = manifests::Log::new(workdir.join("cache").join(LOG));
        // An unreadable log is read again at the first lookup, which reports it.
        let _ = log.refresh();
        LogRead(log)
    }
}

#[derive(Clone)]
pub struct Store {
    root: PathBuf,
    /// Entries this process already found intact (fast check), so that planning and running
    /// check each entry once. Entries are immutable once committed; `remove` forgets them.
    checked: Arc<Mutex<std::collections::HashMap<String, Arc<Manifest>>>>,
    log: Arc<Mutex<manifests::Log>>,
    /// `root`, held open: entries are checked from it. `None` for a read-only store of a
    /// workdir that has no cache yet.
    dir: Option<Arc<OpenDir>>,
    /// Planning, rendering and other questions: nothing is created, moved or removed.
    read_only: bool,
    /// The shared lock on `LIVE`, held as long as a writing store (a run) lives.
    _live: Option<Arc<File>>,
    /// A problem with the log is reported once, not once per entry.
    warned: Arc<AtomicBool>,
}

/// Held while a key is being computed, so two runs never compute the same key at once: an OFD
/// lock on one byte of `cache/.lock` chosen by the key, so that locking creates no file per key.
/// Each lock has its own open file, so two tasks of one process exclude each other too.
pub struct KeyLock {
    _file: File,
}

impl Store {
    /// The cache of `workdir` for a run: the workdir is claimed (created, or checked to be
    /// mflow's, and marked), and the store takes part in the run-wide lock until it is dropped.
    pub fn open(workdir: &Path) -> Result<Store, CacheError> {
        workdir::claim(workdir)?;
        let root = workdir.join("cache");
        for d in [root.join(staging::DIR), root.join(".trash")] {
            fs::create_dir_all(&d).map_err(io_err("cannot create", &d))?;
        }
        let lock = root.join(LOCK);
        let live = files::open(&lock, fs::OpenOptions::new().read(true).write(true).create(true)).map_err(io_err("cannot open the lock file", &lock))?;
        hold_live(&live, workdir).map_err(io_err("cannot lock", &lock))?;
        // Leftovers of attempts that are over; names of no key only while no other run is live.
        if staging::sweep(&root, false) > 0 && ofd_lock(&live, libc::F_WRLCK, LIVE, 1, false).unwrap_or(false) {
            staging::sweep(&root, true);
            ofd_lock(&live, libc::F_RDLCK, LIVE, 1, false).map_err(io_err("cannot lock", &lock))?;
        }
        let log = manifests::Log::new(root.join(LOG));
        // A run appends to the log: a FIFO, a directory or an unreadable file there is reported
        // before any stage runs rather than at the first commit.
        log.check_usable().map_err(|cause| CacheError::Log { path: log.path().to_path_buf(), workdir: workdir.to_path_buf(), cause })?;
        let dir = Arc::new(OpenDir::open(&root).map_err(io_err("cannot open", &root))?);
        Ok(Store {
            root,
            checked: Default::default(),
            log: Arc::new(Mutex::new(log)),
            dir: Some(dir),
            read_only: false,
            _live: Some(Arc::new(live)),
            warned: Default::default(),
        })
    }

    /// The cache of `workdir` for commands that only look (`plan`, `render`, `why`): nothing is
    /// created there, and an entry that does not check out is reported, never removed.
    pub fn open_read_only(workdir: &Path) -> Store {
        let root = workdir.join("cache");
        let log = manifests::Log::new(root.join(LOG));
        let dir = OpenDir::open(&root).ok().map(Arc::new);
        Store { root, checked: Default::default(), log: Arc::new(Mutex::new(log)), dir, read_only: true, _live: None, warned: Default::default() }
    }

    fn lstat(&self, rel: &Path) -> io::Result<dir::FileStat> {
        match &self.dir {
            Some(d) => d.lstat(rel),
            None => Err(io::ErrorKind::NotFound.into()),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Takes `read` as this store's manifest log when it is this store's, before any lookup.
    pub fn adopt(&self, read: LogRead) -> bool {
        let mut log = self.log.lock().unwrap();
        if read.0.path() != log.path() {
            return false;
        }
        *log = read.0;
        true
    }

    /// Reads the manifest log on another thread while the caller plans: the first lookup then
    /// finds it read (or waits for the rest).
    pub fn read_ahead(&self) {
        let log = self.log.clone();
        std::thread::spawn(move || {
            let _ = log.lock().unwrap().refresh();
        });
    }

    /// The committed entry of `key`: the stage's output directory.
    pub fn output_dir(&self, key: &str) -> PathBuf {
        self.root.join(key)
    }

    /// Checks an entry: sizes only by default, full digests with `verify`.
    pub fn lookup(&self, key: &str, verify: bool) -> Lookup {
        if !verify {
            if let Some(m) = self.checked.lock().unwrap().get(key) {
                return Lookup::Hit(m.clone());
            }
        }
        let checked = match self.check(key, verify, false) {
            // No entry at all is a plain miss; checked after the fact, as hits are the common case.
            Err(_) if self.lstat(Path::new(key)).is_err() => return Lookup::Miss,
            // Another run may have committed the key again since this one read the log: a
            // failed check is repeated with the newest manifest before the entry counts as corrupt.
            Err(_) => self.check(key, verify, true),
            ok => ok,
        };
        match checked {
            Ok(m) => {
                self.checked.lock().unwrap().insert(key.to_string(), m.clone());
                Lookup::Hit(m)
            }
            Err(Failure::Unverified(reason, log_problem)) => {
                if let Some(problem) = log_problem {
                    self.warn_once(&problem);
                }
                Lookup::Corrupt(reason)
            }
            Err(Failure::Damaged(reason)) => {
                if !self.read_only {
                    let _ = self.remove(key);
                }
                Lookup::Corrupt(reason)
            }
        }
    }

    /// The manifest of a committed entry, without checking files.
    pub fn manifest(&self, key: &str) -> Option<Arc<Manifest>> {
        self.log.lock().unwrap().get(key, false).ok().flatten()
    }

    /// Checks the entry of `key` (sizes only) against `m`, its manifest from the log, and
    /// remembers it as intact when it checks out, so that the next `lookup` finds it at once.
    /// An entry that does not check out is left to `lookup` to judge.
    pub fn accept(&self, key: &str, m: Arc<Manifest>) {
        if self.check_entry(key, &m, false).is_ok() {
            self.checked.lock().unwrap().insert(key.to_string(), m);
        }
    }

    fn check(&self, key: &str, verify: bool, fresh: bool) -> Result<Arc<Manifest>, Failure> {
        let mut log = self.log.lock().unwrap();
        let path = log.path().display().to_string();
        let m = match log.get(key, fresh) {
            Ok(m) => m,
            Err(e) => {
                let problem = format!("the manifest log {path} cannot be read ({e})");
                return Err(Failure::Unverified(format!("unverified: {problem}; the entry is left in place"), Some(problem)));
            }
        };
        let Some(m) = m else {
            if !log.found() {
                let problem = format!("the manifest log {path} is missing");
                return Err(Failure::Unverified(format!("unverified: {problem}; the entry is left in place"), Some(problem)));
            }
            return Err(Failure::Unverified(format!("unverified: the manifest log {path} has no line for it; the entry is left in place"), None));
        };
        drop(log);
        self.check_entry(key, &m, verify).map_err(Failure::Damaged)?;
        Ok(m)
    }

    fn warn_once(&self, problem: &str) {
        if !self.warned.swap(true, Ordering::Relaxed) {
            let workdir = self.root.parent().unwrap_or(&self.root);
            tracing::warn!(
                "{problem}: the cache entries in {} are unverified and left in place (stages rerun); `mflow cache repair --workdir {}` rebuilds the log from the entries that match their run records",
                self.root.display(),
                workdir.display()
            );
        }
    }

    fn check_entry(&self, key: &str, m: &Manifest, verify: bool) -> Result<(), String> {
        if m.key != key {
            return Err(format!("manifest names key {}", m.key));
        }
        if digest_of(&m.files) != m.digest {
            return Err("manifest digest does not match its file list".into());
        }
        for f in &m.files {
            let rel = safe_join(Path::new(key), &f.path).ok_or_else(|| format!("manifest path `{}` escapes the entry", f.path))?;
            // Not followed: an entry holds only regular files, and reading a FIFO would block.
            let st = self.lstat(&rel).map_err(|_| format!("`{}` is missing", f.path))?;
            if !st.is_file {
                return Err(format!("`{}` is not a regular file", f.path));
            }
            if st.len != f.size {
                return Err(format!("`{}` has {} bytes, the manifest says {}", f.path, st.len, f.size));
            }
            if verify {
                let full = self.root.join(&rel);
                if hash_file(&full).map_err(|e| format!("cannot read {}: {e}", full.display()))? != f.blake3 {
                    return Err(format!("`{}` does not match its digest", f.path));
                }
            }
        }
        Ok(())
    }

    /// A fresh staging directory for `key`, which becomes the entry (the stage writes into it),
    /// inside a directory of the attempt (`staging`); stale ones of the same key (from a killed
    /// run) are removed first. Call with the key's lock held.
    pub fn stage(&self, key: &str, run_id: &str) -> Result<PathBuf, CacheError> {
        let area = self.root.join(staging::DIR);
        if let Ok(rd) = fs::read_dir(&area) {
            for e in rd.flatten() {
                if e.file_name().as_encoded_bytes().starts_with(format!("{key}.").as_bytes()) {
                    let _ = staging::remove(&e.path());
                }
            }
        }
        let dir = staging::output(&self.root, key, run_id);
        fs::create_dir_all(&dir).map_err(io_err("cannot create", &dir))?;
        Ok(dir)
    }

    /// The attempt directory of a staged output from `stage`: what the stage may write beside
    /// its output, and what `discard` and a commit remove.
    pub fn attempt_dir<'a>(&self, staging: &'a Path) -> &'a Path {
        staging::attempt_of(&self.root, staging).unwrap_or(staging)
    }

    /// Records the manifest of `staging` and renames it into place. Call with the key's lock
    /// held.
    pub fn commit(&self, staging: &Path, key: &str, stage: &str) -> Result<Manifest, CacheError> {
        self.commit_listed(Staged::list(staging)?, key, stage)
    }

    /// Hashes a listed output and commits it.
    pub fn commit_listed(&self, staged: Staged, key: &str, stage: &str) -> Result<Manifest, CacheError> {
        let result = self.commit_staged(&staged, key, stage);
        // The output was moved into place or is not needed; the rest of the attempt goes.
        self.discard(&staged.dir);
        result
    }

    fn commit_staged(&self, staged: &Staged, key: &str, stage: &str) -> Result<Manifest, CacheError> {
        let staging = staged.dir.as_path();
        let files = staged.hash()?;
        let manifest = Manifest { version: 1, key: key.to_string(), stage: stage.to_string(), digest: digest_of(&files), files };
        let dest = self.output_dir(key);
        if fs::symlink_metadata(&dest).is_ok() {
            // Committed by someone else meanwhile (theirs stands), or damaged (the lookup
            // removes it), or not vouched for by the log.
            if let Lookup::Hit(m) = self.lookup(key, false) {
                let _ = fs::remove_dir_all(staging);
                return Ok(Manifest::clone(&m));
            }
            if fs::symlink_metadata(&dest).is_ok() {
                // Never deleted: kept when it holds exactly this output, else set aside.
                if same_files(&dest, &manifest) {
                    let mut log = self.log.lock().unwrap();
                    let _appended = log.append(&manifest).map_err(io_err("cannot append to the manifest log", log.path()))?;
                    drop(log);
                    let _ = fs::remove_dir_all(staging);
                    return Ok(manifest);
                }
                let aside = self.set_aside(key)?;
                tracing::warn!("cache entry {key} was not in the manifest log and differs from the new output: moved to {}", aside.display());
            }
        }
        // No fsync per entry: it cost more than a small stage itself. A power loss can leave an
        // entry with a short or empty file or a torn manifest line; the size check on lookup
        // turns that into a miss, and `--verify` rehashes what sizes cannot catch.
        let mut log = self.log.lock().unwrap();
        let _appending = log.append(&manifest).map_err(io_err("cannot append to the manifest log", log.path()))?;
        fs::rename(staging, &dest).map_err(io_err("cannot move the staged output into place at", &dest))?;
        Ok(manifest)
    }

    /// Moves the entry of `key` to `cache/.unverified/`, where nothing deletes it.
    fn set_aside(&self, key: &str) -> Result<PathBuf, CacheError> {
        set_aside(&self.root, key)
    }

    /// Drops the manifest lines of entries that are gone.
    pub fn compact(&self) -> Result<(), CacheError> {
        let mut log = self.log.lock().unwrap();
        log.compact(|key| self.output_dir(key).is_dir()).map_err(io_err("cannot rewrite the manifest log", log.path()))
    }

    /// Removes a staged output and everything else of its attempt.
    pub fn discard(&self, staging: &Path) {
        let _ = staging::remove(self.attempt_dir(staging));
    }

    /// Moves an entry out of the way, then deletes it.
    pub fn remove(&self, key: &str) -> Result<(), CacheError> {
        self.checked.lock().unwrap().remove(key);
        remove_entry(&self.root, key)
    }

    /// Blocks until this process holds the key's lock.
    pub fn lock(&self, key: &str) -> Result<KeyLock, CacheError> {
        lock_key(&self.root, key, true).map(|l| l.expect("a blocking lock is taken"))
    }

    /// Takes the key's lock if it is free.
    pub fn try_lock(&self, key: &str) -> Result<Option<KeyLock>, CacheError> {
        lock_key(&self.root, key, false)
    }

    /// Bytes on disk of an entry.
    pub fn size(&self, key: &str) -> u64 {
        self.manifest(key).map(|m| m.bytes()).unwrap_or(0)
    }
}

/// The lock of `key` in the cache at `root`, on an open file of its own.
fn lock_key(root: &Path, key: &str, wait: bool) -> Result<Option<KeyLock>, CacheError> {
    let path = root.join(LOCK);
    let file = files::open(&path, fs::OpenOptions::new().read(true).write(true)).map_err(io_err("cannot open the lock file", &path))?;
    match ofd_lock(&file, libc::F_WRLCK, lock_offset(key), 1, wait) {
        Ok(true) => Ok(Some(KeyLock { _file: file })),
        Ok(false) => Ok(None),
        Err(cause) => Err(CacheError::Io { op: "cannot lock", path, cause }),
    }
}

/// Takes the shared run-wide lock, waiting (and saying so) while `gc` or `cache repair` holds it.
fn hold_live(file: &File, workdir: &Path) -> io::Result<()> {
    if ofd_lock(file, libc::F_RDLCK, LIVE, 1, false)? {
        return Ok(());
    }
    tracing::warn!("waiting for `mflow gc` or `mflow cache repair` on {} to finish", workdir.display());
    ofd_lock(file, libc::F_RDLCK, LIVE, 1, true).map(drop)
}

/// Moves an entry into `.trash` (so that it leaves its place at once), then deletes it.
fn remove_entry(root: &Path, key: &str) -> Result<(), CacheError> {
    let dir = root.join(key);
    let trash_dir = root.join(".trash");
    fs::create_dir_all(&trash_dir).map_err(io_err("cannot create", &trash_dir))?;
    let trash = trash_dir.join(format!("{key}.{}", fastrand::u64(..)));
    fs::rename(&dir, &trash).map_err(io_err("cannot move the entry to the trash:", &dir))?;
    fs::remove_dir_all(&trash).map_err(io_err("cannot remove", &trash))
}

/// Moves the entry of `key` to `.unverified/<key>.<n>`: out of the way of a new entry, and out
/// of reach of everything that deletes.
fn set_aside(root: &Path, key: &str) -> Result<PathBuf, CacheError> {
    let dir = root.join(key);
    let aside_dir = root.join(".unverified");
    fs::create_dir_all(&aside_dir).map_err(io_err("cannot create", &aside_dir))?;
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let aside = aside_dir.join(format!("{key}.{stamp}-{:04x}", fastrand::u16(..)));
    fs::rename(&dir, &aside).map_err(io_err("cannot set aside", &dir))?;
    Ok(aside)
}

/// Whether the directory `dir` holds exactly the files of `m`, byte for byte.
fn same_files(dir: &Path, m: &Manifest) -> bool {
    Staged::list(dir).and_then(|s| s.hash()).is_ok_and(|files| files == m.files)
}

/// Takes an OFD lock (`kind` is `F_RDLCK` or `F_WRLCK`) on `len` bytes of `file` from `start`
/// (0: to the end); false when `wait` is off and someone else holds it. The lock belongs to the
/// open file, so two opens in one process exclude each other too; closing the file releases it.
fn ofd_lock(file: &File, kind: libc::c_int, start: libc::off_t, len: libc::off_t, wait: bool) -> io::Result<bool> {
    use std::os::fd::AsRawFd;
    // SAFETY: an all-zero flock is a valid value; the fields that matter are set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as _;
    fl.l_whence = libc::SEEK_SET as _;
    fl.l_start = start;
    fl.l_len = len;
    let cmd = if wait { libc::F_OFD_SETLKW } else { libc::F_OFD_SETLK };
    loop {
        // SAFETY: fcntl with an OFD lock command reads the flock we own; the fd is open.
        if unsafe { libc::fcntl(file.as_raw_fd(), cmd, &fl) } == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN | libc::EACCES) if !wait => return Ok(false),
            _ => return Err(e),
        }
    }
}

/// The byte of `cache/.lock` that stands for `key`: 62 bits of its hash, so that two keys share
/// a byte (and wait for each other) with negligible probability.
fn lock_offset(key: &str) -> libc::off_t {
    let h = blake3::hash(key.as_bytes());
    (u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes")) >> 2) as libc::off_t
}

/// Whether `name` has the shape of a key (64 lower-case hex digits): the only names `gc` and
/// `cache repair` act on, whatever the log says.
fn is_key(name: &str) -> bool {
    name.len() == 64 && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Joins a manifest's relative path under `base`, refusing anything that could escape it.
pub fn safe_join(base: &Path, rel: &str) -> Option<PathBuf> {
    let p = Path::new(rel);
    if p.is_absolute() || p.components().any(|c| !matches!(c, std::path::Component::Normal(_))) {
        return None;
    }
    Some(base.join(p))
}

/// A staged output's files and sizes, listed before anything is hashed, so that the caller
/// can choose where the hashing runs.
pub struct Staged {
    dir: PathBuf,
    files: Vec<(String, u64)>,
}

impl Staged {
    pub fn list(dir: &Path) -> Result<Staged, CacheError> {
        let mut paths = Vec::new();
        walk(dir, dir, &mut paths)?;
        paths.sort();
        let mut files = Vec::with_capacity(paths.len());
        for rel in paths {
            let full = dir.join(&rel);
            let size = fs::metadata(&full).map_err(io_err("cannot stat", &full))?.len();
            files.push((rel, size));
        }
        Ok(Staged { dir: dir.to_path_buf(), files })
    }

    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|(_, size)| size).sum()
    }

    fn hash(&self) -> Result<Vec<FileEntry>, CacheError> {
        self.files
            .iter()
            .map(|(rel, size)| {
                let full = self.dir.join(rel);
                let blake3 = hash_file(&full).map_err(io_err("cannot hash", &full))?;
                Ok(FileEntry { path: rel.clone(), size: *size, blake3 })
            })
            .collect()
    }
}

fn walk(base: &Path, dir: &Path, out: &mut Vec<String>) -> Result<(), CacheError> {
    for e in fs::read_dir(dir).map_err(io_err("cannot list", dir))? {
        let e = e.map_err(io_err("cannot list", dir))?;
        let ft = e.file_type().map_err(io_err("cannot stat", &e.path()))?;
        let path = e.path();
        if ft.is_dir() {
            walk(base, &path, out)?;
        } else if ft.is_file() {
            let rel = path.strip_prefix(base).expect("under base");
            // Manifests and lockfiles hold names as text: a lossy name would not match the file.
            let rel = rel.to_str().ok_or_else(|| CacheError::NotUtf8 { name: format!("{:?}", rel.as_os_str()) })?;
            out.push(rel.replace('\\', "/"));
        } else {
            return Err(CacheError::FileType { path });
        }
    }
    Ok(())
}

/// Files from this size on are mapped rather than read.
const MAP_FROM: u64 = 1 << 20;
/// A mapped file is hashed this much at a time, on all cores.
const HASH_WINDOW: usize = 16 << 20;

/// blake3 of a file. A large file is mapped and hashed window by window, and each window is
/// dropped from this process once hashed: mapped pages count in its RSS, and a checkpoint is
/// gigabytes (a whole mapping of one 1 GB file was 1 GB of RSS; a window keeps it at 16 MiB, at
/// the same speed).
pub fn hash_file(path: &Path) -> io::Result<String> {
    let mut h = blake3::Hasher::new();
    // A FIFO in a file's place is refused instead of blocking the open.
    let file = mflow_untrusted::open_regular(path)?;
    let meta = file.metadata()?;
    if meta.len() < MAP_FROM {
        h.update_reader(&file)?;
        return Ok(h.finalize().to_hex().to_string());
    }
    // SAFETY: outputs are not written once their stage has ended, which is when they are hashed.
    let map = unsafe { memmap2::Mmap::map(&file)? };
    let mut start = 0;
    while start < map.len() {
        let end = (start + HASH_WINDOW).min(map.len());
        h.update_rayon(&map[start..end]);
        // SAFETY: the window is not read again; for a file mapping, this only unmaps its pages.
        unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)? };
        start = end;
    }
    Ok(h.finalize().to_hex().to_string())
}

/// The identity of an output: the digest of its file list.
pub fn digest_of(files: &[FileEntry]) -> String {
    let mut h = blake3::Hasher::new();
    for f in files {
        h.update(&(f.path.len() as u64).to_le_bytes());
        h.update(f.path.as_bytes());
        h.update(&f.size.to_le_bytes());
        h.update(f.blake3.as_bytes());
    }
    h.finalize().to_hex().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_file_hashed_in_windows_has_its_whole_digest() {
        let tmp = tempfile::tempdir().unwrap();
        for len in [0, 5, MAP_FROM as usize, 2 * HASH_WINDOW + 12_345] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let path = tmp.path().join(format!("f{len}"));
            fs::write(&path, &bytes).unwrap();
            assert_eq!(hash_file(&path).unwrap(), blake3::hash(&bytes).to_hex().to_string(), "{len} bytes");
        }
    }

    /// A staging directory of `key` holding `files`, with the key's lock.
    fn stage_files(store: &Store, key: &str, files: &[(&str, &[u8])]) -> (KeyLock, PathBuf) {
        let lock = store.lock(key).unwrap();
        let st = store.stage(key, "r").unwrap();
        for (path, bytes) in files {
            let p = st.join(path);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, bytes).unwrap();
        }
        (lock, st)
    }

    #[test]
    fn commit_then_hit_then_corruption_is_a_miss() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path()).unwrap();
        let (_l, st) = stage_files(&store, "k1", &[("sub/a.txt", b"hello")]);
        let m = store.commit(&st, "k1", "s").unwrap();
        assert_eq!(m.files.len(), 1);
        assert!(matches!(store.lookup("k1", true), Lookup::Hit(_)));
        // Same size, other bytes: only a full verify notices.
        fs::write(store.output_dir("k1").join("sub/a.txt"), b"jello").unwrap();
        assert!(matches!(store.lookup("k1", false), Lookup::Hit(_)));
        assert!(matches!(store.lookup("k1", true), Lookup::Corrupt(_)));
        assert!(matches!(store.lookup("k1", false), Lookup::Miss));
    }

    fn commit_file(store: &Store, key: &str, text: &str) -> Manifest {
        let (_l, st) = stage_files(store, key, &[("f", text.as_bytes())]);
        store.commit(&st, key, "s").unwrap()
    }

    #[test]
    fn a_listed_output_knows_its_size_before_hashing() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path()).unwrap();
        let (_l, st) = stage_files(&store, "k", &[("d/b", &[7u8; 5000]), ("a", b"abc")]);
        let staged = Staged::list(&st).unwrap();
        assert_eq!(staged.bytes(), 5003);
        let m = store.commit_listed(staged, "k", "s").unwrap();
        let paths: Vec<_> = m.files.iter().map(|f| (f.path.as_str(), f.size)).collect();
        assert_eq!(paths, [("a", 3), ("d/b", 5000)]);
        assert_eq!(m.files[0].blake3, blake3::hash(b"abc").to_hex().to_string());
        assert!(matches!(store.lookup("k", true), Lookup::Hit(h) if *h == m));
    }

    #[test]
    fn a_commit_creates_only_the_output_and_one_manifest_line() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path()).unwrap();
        commit_file(&store, "k1", "one");
        commit_file(&store, "k2", "two");
        let names: Vec<String> = fs::read_dir(store.output_dir("k1")).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
        assert_eq!(names, ["f"]);
        let log = fs::read_to_string(tmp.path().join("cache/.manifests.jsonl")).unwrap();
        assert_eq!(log.lines().count(), 2);
        // Another process (a fresh store) reads the entries from the log.
        let other = Store::open(tmp.path()).unwrap();
        assert!(matches!(other.lookup("k2", true), Lookup::Hit(m) if m.files[0].size == 3));
    }

    #[test]
    fn entries_committed_by_another_store_are_seen_and_a_directory_without_manifest_is_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (Store::open(tmp.path()).unwrap(), Store::open(tmp.path()).unwrap());
        assert!(matches!(a.lookup("k", false), Lookup::Miss));
        commit_file(&b, "k", "x");
        assert!(matches!(a.lookup("k", false), Lookup::Hit(_)));
        fs::create_dir_all(a.output_dir("stray")).unwrap();
        assert!(matches!(a.lookup("stray", false), Lookup::Corrupt(why) if why.contains("no line")));
        assert!(a.output_dir("stray").exists(), "an entry the log does not know was deleted");
    }

    #[test]
    fn an_unknown_entry_is_kept_when_the_rerun_matches_it_and_set_aside_when_not() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path()).unwrap();
        commit_file(&store, "same", "one");
        commit_file(&store, "other", "two");
        let log = tmp.path().join("cache").join(LOG);
        fs::remove_file(&log).unwrap();
        let fresh = Store::open(tmp.path()).unwrap();
        for key in ["same", "other"] {
            assert!(matches!(fresh.lookup(key, false), Lookup::Corrupt(why) if why.contains("is missing")));
            assert!(fresh.output_dir(key).is_dir());
        }
        let kept = fs::metadata(fresh.output_dir("same")).unwrap();
        commit_file(&fresh, "same", "one");
        commit_file(&fresh, "other", "changed");
        use std::os::unix::fs::MetadataExt;
        assert_eq!(fs::metadata(fresh.output_dir("same")).unwrap().ino(), kept.ino(), "an identical entry was replaced");
        assert_eq!(fs::read_to_string(fresh.output_dir("other").join("f")).unwrap(), "changed");
        let aside: Vec<_> = fs::read_dir(tmp.path().join("cache/.unverified")).unwrap().flatten().map(|e| e.path()).collect();
        assert_eq!(aside.len(), 1);
        assert_eq!(fs::read_to_string(aside[0].join("f")).unwrap(), "two");
        let again = Store::open(tmp.path()).unwrap();
        assert!(matches!(again.lookup("same", true), Lookup::Hit(_)));
        assert!(matches!(again.lookup("other", true), Lookup::Hit(_)));
    }

    #[test]
    fn a_log_that_is_not_a_regular_file_is_refused_by_a_run_and_keeps_every_entry_for_a_look() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path()).unwrap();
        commit_file(&store, "k", "one");
        let log = tmp.path().join("cache").join(LOG);
        fs::remove_file(&log).unwrap();
        fs::create_dir(&log).unwrap();
        let e = Store::open(tmp.path()).err().expect("a run refuses a directory in the log's place");
        assert!(e.to_string().contains(".manifests.jsonl") && e.to_string().contains("a directory"), "{e}");
        let look = Store::open_read_only(tmp.path());
        assert!(matches!(look.lookup("k", true), Lookup::Corrupt(why) if why.contains("a directory")));
        assert!(look.output_dir("k").join("f").is_file());
    }

    #[test]
    fn an_io_error_names_the_path_and_its_cause() {
        let e = io_err("cannot append to the manifest log", Path::new("w/cache/.manifests.jsonl"))(io::Error::from_raw_os_error(libc::ENOSPC));
        let text = e.to_string();
        assert!(text.contains("w/cache/.manifests.jsonl") && text.contains("No space left on device"), "{text}");
    }

    #[test]
    fn a_live_store_holds_off_the_exclusive_lock() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path()).unwrap();
        let lock = files::open(&tmp.path().join("cache").join(LOCK), fs::OpenOptions::new().read(true).write(true)).unwrap();
        assert!(!ofd_lock(&lock, libc::F_WRLCK, LIVE, 1, false).unwrap());
        assert!(ofd_lock(&lock, libc::F_RDLCK, LIVE, 1, false).unwrap(), "two runs share it");
        let _ = ofd_lock(&lock, libc::F_UNLCK, LIVE, 1, false);
        drop(store);
        assert!(ofd_lock(&lock, libc::F_WRLCK, LIVE, 1, false).unwrap());
    }

    #[test]
    fn a_torn_line_costs_only_its_own_entry() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path()).unwrap();
        commit_file(&store, "k1", "one");
        let log = tmp.path().join("cache/.manifests.jsonl");
        fs::OpenOptions::new().append(true).open(&log).unwrap().write_all(b"{\"version\":1,\"ke").unwrap();
        commit_file(&store, "k2", "two");
        let fresh = Store::open(tmp.path()).unwrap();
        assert!(matches!(fresh.lookup("k1", false), Lookup::Hit(_)));
        assert!(matches!(fresh.lookup("k2", false), Lookup::Hit(_)));
    }

    #[test]
    fn compaction_keeps_the_lines_of_existing_entries() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path()).unwrap();
        let reader = Store::open(tmp.path()).unwrap();
        commit_file(&store, "k1", "one");
        commit_file(&store, "k2", "two");
        assert!(matches!(reader.lookup("k1", false), Lookup::Hit(_)));
        store.remove("k1").unwrap();
        store.compact().unwrap();
        let log = fs::read_to_string(tmp.path().join("cache/.manifests.jsonl")).unwrap();
        assert_eq!(log.lines().count(), 1);
        assert!(log.contains("\"k2\""));
        // A reader that had the old file open follows the compacted one.
        commit_file(&store, "k3", "three");
        assert!(matches!(reader.lookup("k3", false), Lookup::Hit(_)));
        assert!(matches!(reader.lookup("k2", false), Lookup::Hit(_)));
        assert!(matches!(reader.lookup("k1", true), Lookup::Miss));
    }

    #[test]
    fn manifest_paths_cannot_escape() {
        assert!(safe_join(Path::new("/a"), "../b").is_none());
        assert!(safe_join(Path::new("/a"), "/etc/passwd").is_none());
        assert!(safe_join(Path::new("/a"), "b/c").is_some());
    }

    #[test]
    fn key_lock_is_exclusive() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path()).unwrap();
        let held = store.try_lock("k").unwrap();
        assert!(held.is_some());
        assert!(store.try_lock("k").unwrap().is_none());
        drop(held);
        assert!(store.try_lock("k").unwrap().is_some());
        let _other = store.try_lock("other").unwrap().expect("another key is not blocked");
    }
}
