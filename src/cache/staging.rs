//! `cache/.staging/`: one directory per attempt, `<key>.<run>/`, with the stage's output in
//! `out/` (`MFLOW_OUTPUT`) and its report files beside it. Whatever the stage writes next to
//! its output stays inside the attempt's directory, which goes when the attempt ends. An
//! attempt that runs as a TrainJob has its area in `cache/.kube/<trainjob>/` instead, laid out
//! the same way and prepared by the backend ([`AttemptArea`]).

use std::fs;
use std::io;
use std::path::Path;

use super::lock::lock_key;
use super::{io_err, is_key, CacheError, Store};
use crate::workdir::{AttemptArea, Workdir};

impl Store {
    /// Gets the area of an attempt of `key` ready: staging directories of the key left by a
    /// killed run go; an area of the engine's own is created afresh, with its output directory
    /// when `with_output` (native commands create theirs, atomically). A reattachable area
    /// (a TrainJob's) is the backend's to prepare. Call with the key's lock held.
    pub fn prepare(&self, key: &str, area: &AttemptArea, with_output: bool) -> Result<(), CacheError> {
        let workdir = self.workdir();
        if let Ok(rd) = fs::read_dir(workdir.staging_area()) {
            for e in rd.flatten() {
                if e.file_name().as_encoded_bytes().starts_with(format!("{key}.").as_bytes()) {
                    let _ = remove(&e.path());
                }
            }
        }
        if area.reattachable {
            return Ok(());
        }
        let dir = if with_output { &area.out } else { &area.dir };
        fs::create_dir_all(dir).map_err(io_err("cannot create", dir))
    }
}

/// Removes a file or a directory tree, whichever `path` is (a link itself, not its target).
pub fn remove(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Removes what attempts that are over left in the staging area: a `<key>.*` name whose key
/// no one holds the lock of (an attempt holds it throughout), and, when `sole` (no other run
/// is live), everything. Returns what is left of other names, for the caller to retry when sole.
pub fn sweep(workdir: &Workdir, sole: bool) -> usize {
    let Ok(rd) = fs::read_dir(workdir.staging_area()) else { return 0 };
    let mut left = 0;
    for e in rd.flatten() {
        let name = e.file_name();
        let key = name.to_str().and_then(|n| n.split_once('.')).map(|(k, _)| k).filter(|k| is_key(k));
        let unused = match key {
            Some(k) => lock_key(workdir, k, false).ok().flatten(),
            None => None,
        };
        if sole || unused.is_some() {
            let _ = remove(&e.path());
        } else {
            left += 1;
        }
    }
    left
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attempts_area_is_made_by_its_owner() {
        let tmp = tempfile::tempdir().unwrap();
        let workdir = Workdir::new(tmp.path());
        let store = Store::open(&workdir).unwrap();
        let stale = workdir.staged_attempt("k", "old");
        fs::create_dir_all(&stale.out).unwrap();

        let native = workdir.staged_attempt("k", "r1");
        store.prepare("k", &native, false).unwrap();
        assert!(native.dir.is_dir() && !native.out.exists(), "a native command creates its output");
        assert!(!stale.dir.exists(), "what a killed run left of the key goes");

        let local = workdir.staged_attempt("k", "r2");
        store.prepare("k", &local, true).unwrap();
        assert!(local.out.is_dir());

        let trainjob = workdir.trainjob_attempt("p-s-k");
        store.prepare("k", &trainjob, true).unwrap();
        assert!(!trainjob.dir.exists(), "a TrainJob's area is the backend's to prepare");
    }
}
