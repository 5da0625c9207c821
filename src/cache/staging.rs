//! `cache/.staging/`: one directory per attempt, `<key>.<run>/`, with the stage's output in
//! `out/` (`MFLOW_OUTPUT`) and its report files beside it. Whatever the stage writes next to
//! its output stays inside the attempt's directory, which goes when the attempt ends.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::{is_key, lock_key};

/// The staging area, relative to the cache.
pub const DIR: &str = ".staging";
/// The output directory inside an attempt's directory.
const OUT: &str = "out";

/// The output directory of the attempt `<key>.<run_id>`.
pub fn output(root: &Path, key: &str, run_id: &str) -> PathBuf {
    root.join(DIR).join(format!("{key}.{run_id}")).join(OUT)
}

/// The attempt directory that holds the staged output `out`, when `out` is laid out as above.
pub fn attempt_of<'a>(root: &Path, out: &'a Path) -> Option<&'a Path> {
    let attempt = out.parent()?;
    (out.file_name()? == OUT && attempt.parent()? == root.join(DIR)).then_some(attempt)
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
pub fn sweep(root: &Path, sole: bool) -> usize {
    let Ok(rd) = fs::read_dir(root.join(DIR)) else { return 0 };
    let mut left = 0;
    for e in rd.flatten() {
        let name = e.file_name();
        let key = name.to_str().and_then(|n| n.split_once('.')).map(|(k, _)| k).filter(|k| is_key(k));
        let unused = match key {
            Some(k) => lock_key(root, k, false).ok().flatten(),
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
