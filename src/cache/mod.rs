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
mod entries;
mod error;
pub(crate) mod files;
pub mod key;
mod lock;
mod maintain;
mod manifests;
mod staged;
mod staging;

pub use dir::{FileStat, OpenDir};
pub(crate) use error::io_err;
pub use error::CacheError;
pub(crate) use files::read_regular;
pub use lock::KeyLock;
pub use staged::{digest_of, hash_file, Staged};

/// Largest state file mflow reads back (stat caches, keys, run records, lockfiles).
pub(crate) const MAX_STATE_BYTES: u64 = 1 << 30;
pub use maintain::{gc, repair, GcReport, RepairReport};

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::workdir::{self, Workdir};
use entries::{remove_entry, set_aside};
use lock::{hold_live, lock_key, ofd_lock, LIVE};
use staged::same_files;

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
    pub fn read(workdir: &Workdir) -> LogRead {
        let mut log = manifests::Log::new(workdir.manifest_log());
        // An unreadable log is read again at the first lookup, which reports it.
        let _ = log.refresh();
        LogRead(log)
    }
}

#[derive(Clone)]
pub struct Store {
    workdir: Workdir,
    /// Entries this process already found intact (fast check), so that planning and running
    /// check each entry once. Entries are immutable once committed; `remove` forgets them.
    checked: Arc<Mutex<std::collections::HashMap<String, Arc<Manifest>>>>,
    log: Arc<Mutex<manifests::Log>>,
    /// The cache directory, held open: entries are checked from it. `None` for a read-only store of a
    /// workdir that has no cache yet.
    dir: Option<Arc<OpenDir>>,
    /// Planning, rendering and other questions: nothing is created, moved or removed.
    read_only: bool,
    /// The shared lock on `LIVE`, held as long as a writing store (a run) lives.
    _live: Option<Arc<File>>,
    /// A problem with the log is reported once, not once per entry.
    warned: Arc<AtomicBool>,
}

impl Store {
    /// The cache of `workdir` for a run: the workdir is claimed (created, or checked to be
    /// mflow's, and marked), and the store takes part in the run-wide lock until it is dropped.
    pub fn open(workdir: &Workdir) -> Result<Store, CacheError> {
        workdir::claim(workdir.root())?;
        for d in [workdir.staging_area(), workdir.trash()] {
            fs::create_dir_all(&d).map_err(io_err("cannot create", &d))?;
        }
        let lock = workdir.cache_lock();
        let live = files::open(&lock, fs::OpenOptions::new().read(true).write(true).create(true))
            .map_err(io_err("cannot open the lock file", &lock))?;
        hold_live(&live, workdir).map_err(io_err("cannot lock", &lock))?;
        // Leftovers of attempts that are over; names of no key only while no other run is live.
        if staging::sweep(workdir, false) > 0 && ofd_lock(&live, libc::F_WRLCK, LIVE, 1, false).unwrap_or(false) {
            staging::sweep(workdir, true);
            ofd_lock(&live, libc::F_RDLCK, LIVE, 1, false).map_err(io_err("cannot lock", &lock))?;
        }
        let log = manifests::Log::new(workdir.manifest_log());
        // A run appends to the log: a FIFO, a directory or an unreadable file there is reported
        // before any stage runs rather than at the first commit.
        log.check_usable().map_err(|cause| CacheError::Log {
            path: log.path().to_path_buf(),
            workdir: workdir.root().to_path_buf(),
            cause,
        })?;
        let root = workdir.cache();
        let dir = Arc::new(OpenDir::open(&root).map_err(io_err("cannot open", &root))?);
        Ok(Store {
            workdir: workdir.clone(),
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
    pub fn open_read_only(workdir: &Workdir) -> Store {
        let log = manifests::Log::new(workdir.manifest_log());
        let dir = OpenDir::open(&workdir.cache()).ok().map(Arc::new);
        Store {
            workdir: workdir.clone(),
            checked: Default::default(),
            log: Arc::new(Mutex::new(log)),
            dir,
            read_only: true,
            _live: None,
            warned: Default::default(),
        }
    }

    fn lstat(&self, rel: &Path) -> io::Result<dir::FileStat> {
        match &self.dir {
            Some(d) => d.lstat(rel),
            None => Err(io::ErrorKind::NotFound.into()),
        }
    }

    pub fn workdir(&self) -> &Workdir {
        &self.workdir
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
        self.workdir.entry(key)
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
                return Err(Failure::Unverified(
                    format!("unverified: {problem}; the entry is left in place"),
                    Some(problem),
                ));
            }
        };
        let Some(m) = m else {
            if !log.found() {
                let problem = format!("the manifest log {path} is missing");
                return Err(Failure::Unverified(
                    format!("unverified: {problem}; the entry is left in place"),
                    Some(problem),
                ));
            }
            return Err(Failure::Unverified(
                format!("unverified: the manifest log {path} has no line for it; the entry is left in place"),
                None,
            ));
        };
        drop(log);
        self.check_entry(key, &m, verify).map_err(Failure::Damaged)?;
        Ok(m)
    }

    fn warn_once(&self, problem: &str) {
        if !self.warned.swap(true, Ordering::Relaxed) {
            let workdir = self.workdir.display();
            tracing::warn!(
                "{problem}: the cache entries in {} are unverified and left in place (stages rerun); `mflow cache repair --workdir {}` rebuilds the log from the entries that match their run records",
                self.workdir.cache().display(),
                workdir
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
            let rel = safe_join(Path::new(key), &f.path)
                .ok_or_else(|| format!("manifest path `{}` escapes the entry", f.path))?;
            // Not followed: an entry holds only regular files, and reading a FIFO would block.
            let st = self.lstat(&rel).map_err(|_| format!("`{}` is missing", f.path))?;
            if !st.is_file {
                return Err(format!("`{}` is not a regular file", f.path));
            }
            if st.len != f.size {
                return Err(format!("`{}` has {} bytes, the manifest says {}", f.path, st.len, f.size));
            }
            if verify {
                let full = self.workdir.cache().join(&rel);
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
        let area = self.workdir.staging_area();
        if let Ok(rd) = fs::read_dir(&area) {
            for e in rd.flatten() {
                if e.file_name().as_encoded_bytes().starts_with(format!("{key}.").as_bytes()) {
                    let _ = staging::remove(&e.path());
                }
            }
        }
        let dir = self.workdir.staging(key, run_id);
        fs::create_dir_all(&dir).map_err(io_err("cannot create", &dir))?;
        Ok(dir)
    }

    /// The attempt directory of a staged output from `stage`: what the stage may write beside
    /// its output, and what `discard` and a commit remove.
    pub fn attempt_dir<'a>(&self, staging: &'a Path) -> &'a Path {
        self.workdir.attempt_of(staging).unwrap_or(staging)
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
        let manifest =
            Manifest { version: 1, key: key.to_string(), stage: stage.to_string(), digest: digest_of(&files), files };
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
                    let _appended =
                        log.append(&manifest).map_err(io_err("cannot append to the manifest log", log.path()))?;
                    drop(log);
                    let _ = fs::remove_dir_all(staging);
                    return Ok(manifest);
                }
                let aside = self.set_aside(key)?;
                tracing::warn!(
                    "cache entry {key} was not in the manifest log and differs from the new output: moved to {}",
                    aside.display()
                );
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
        set_aside(&self.workdir, key)
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
        remove_entry(&self.workdir, key)
    }

    /// Blocks until this process holds the key's lock.
    pub fn lock(&self, key: &str) -> Result<KeyLock, CacheError> {
        lock_key(&self.workdir, key, true).map(|l| l.expect("a blocking lock is taken"))
    }

    /// Takes the key's lock if it is free.
    pub fn try_lock(&self, key: &str) -> Result<Option<KeyLock>, CacheError> {
        lock_key(&self.workdir, key, false)
    }

    /// Bytes on disk of an entry.
    pub fn size(&self, key: &str) -> u64 {
        self.manifest(key).map(|m| m.bytes()).unwrap_or(0)
    }
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

#[cfg(test)]
mod tests;
