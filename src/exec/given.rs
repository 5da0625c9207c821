//! What a stage is given must stay as its key describes it while the stage runs: its input files
//! (hashed when the run was planned) and the upstream outputs it reads (committed entries, handed
//! over in place). An input edited meanwhile, or a stage that writes into an upstream output,
//! would leave cache entries whose keys do not describe them; the attempt fails instead, and a
//! written upstream output is removed so that it is made again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::cache::FileStat;

/// What identifies a file's content without reading it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Stamp {
    len: u64,
    mtime_ns: i128,
    ino: u64,
    is_file: bool,
}

impl From<&FileStat> for Stamp {
    fn from(m: &FileStat) -> Stamp {
        Stamp { len: m.len, mtime_ns: m.mtime_ns, ino: m.ino, is_file: m.is_file }
    }
}

/// The upstream outputs of one attempt as they were when it started.
pub(super) struct Upstream(Vec<(String, PathBuf, BTreeMap<PathBuf, Stamp>)>);

impl Upstream {
    /// Takes the stamps of every path in each upstream output (stage -> directory).
    pub(super) fn take(upstream: &BTreeMap<String, PathBuf>) -> Upstream {
        Upstream(upstream.iter().map(|(stage, dir)| (stage.clone(), dir.clone(), stamps(dir))).collect())
    }

    /// The first upstream output that is not as it was, with what changed: (stage, directory, why).
    pub(super) fn changed(&self) -> Option<(String, PathBuf, String)> {
        self.0.iter().find_map(|(stage, dir, before)| {
            let now = stamps(dir);
            differs(before, &now).map(|why| (stage.clone(), dir.clone(), why))
        })
    }
}

/// The first input file that is not as it was hashed, and how.
pub(super) fn input_changed(inputs: &[(PathBuf, FileStat)]) -> Option<(PathBuf, &'static str)> {
    inputs.iter().find_map(|(path, hashed)| match std::fs::metadata(path) {
        Err(_) => Some((path.clone(), "is gone")),
        Ok(m) if Stamp::from(&FileStat::from(&m)) != Stamp::from(hashed) => Some((path.clone(), "changed")),
        Ok(_) => None,
    })
}

/// Every path below `dir` (links not followed) with its stamp; empty where `dir` is not here
/// (an output on a cluster's volume).
fn stamps(dir: &Path) -> BTreeMap<PathBuf, Stamp> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let path = e.path();
            let Ok(m) = std::fs::symlink_metadata(&path) else { continue };
            if m.is_dir() {
                todo.push(path.clone());
            }
            let rel = path.strip_prefix(dir).unwrap_or(&path).to_path_buf();
            out.insert(rel, Stamp::from(&FileStat::from(&m)));
        }
    }
    out
}

fn differs(before: &BTreeMap<PathBuf, Stamp>, now: &BTreeMap<PathBuf, Stamp>) -> Option<String> {
    let shown = |p: &Path| format!("`{}`", p.display());
    if let Some(p) = now.keys().find(|p| !before.contains_key(*p)) {
        return Some(format!("{} was added", shown(p)));
    }
    before.iter().find_map(|(p, was)| match now.get(p) {
        None => Some(format!("{} was removed", shown(p))),
        // A directory's own times change with what is in it, which the files say.
        Some(is) if !(was.is_file || is.is_file) => None,
        Some(is) if is != was => Some(format!("{} was written", shown(p))),
        Some(_) => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_added_or_removed_file_is_seen_and_an_untouched_tree_is_not() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("out");
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("f"), "orig").unwrap();
        std::fs::write(dir.join("sub/g"), "g").unwrap();
        let ups = BTreeMap::from([("up".to_string(), dir.clone())]);
        let before = Upstream::take(&ups);
        assert!(before.changed().is_none());
        // Same size, new content: the file was written.
        std::thread::sleep(std::time::Duration::from_millis(10));
        std::fs::write(dir.join("f"), "EVIL").unwrap();
        assert!(before.changed().unwrap().2.contains("`f` was written"));
        let before = Upstream::take(&ups);
        std::fs::write(dir.join("sub/new"), "x").unwrap();
        assert!(before.changed().unwrap().2.contains("`sub/new` was added"));
        let before = Upstream::take(&ups);
        std::fs::remove_file(dir.join("sub/g")).unwrap();
        assert!(before.changed().unwrap().2.contains("`sub/g` was removed"));
        // Nothing there (an output elsewhere) stays nothing.
        let gone = BTreeMap::from([("x".to_string(), tmp.path().join("nowhere"))]);
        assert!(Upstream::take(&gone).changed().is_none());
    }

    #[test]
    fn an_input_is_checked_against_its_stat_when_hashed() {
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("in.txt");
        std::fs::write(&f, "v1").unwrap();
        let hashed = vec![(f.clone(), FileStat::from(&std::fs::metadata(&f).unwrap()))];
        assert!(input_changed(&hashed).is_none());
        std::thread::sleep(std::time::Duration::from_millis(10));
        std::fs::write(&f, "v2").unwrap();
        assert_eq!(input_changed(&hashed).unwrap().1, "changed");
        std::fs::remove_file(&f).unwrap();
        assert_eq!(input_changed(&hashed).unwrap().1, "is gone");
    }
}
