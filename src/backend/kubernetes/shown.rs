//! Which lines of a TrainJob's containers were already shown, kept beside the TrainJob's own
//! output on the volume, so that an mflow that reattaches after a restart does not print them
//! again (each container's log is read from its first line once more).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const FILE: &str = "shown-lines.json";
/// Written at most this often while lines arrive, and once at the end.
const SAVE_EVERY: Duration = Duration::from_secs(1);
/// A record larger than this is not ours to trust (one entry per container instance).
const MAX_BYTES: u64 = 1 << 20;

pub(super) struct ShownLines {
    path: PathBuf,
    /// Lines shown per container instance, by earlier processes and this one.
    shown: BTreeMap<String, u64>,
    /// Lines received per container instance by this process.
    seen: BTreeMap<String, u64>,
    saved: Instant,
    dirty: bool,
}

impl ShownLines {
    /// What earlier processes showed for this TrainJob; nothing when the record is missing or
    /// unreadable (then lines are shown again, which is harmless).
    pub fn load(dir: &Path) -> ShownLines {
        let path = dir.join(FILE);
        let shown = std::fs::metadata(&path)
            .ok()
            .filter(|m| m.is_file() && m.len() <= MAX_BYTES)
            .and_then(|_| std::fs::read(&path).ok())
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        ShownLines { path, shown, seen: BTreeMap::new(), saved: Instant::now(), dirty: false }
    }

    /// Counts a line of `stream` and tells whether it is new to the display. mflow's own
    /// lines (no stream) are always new.
    pub fn first_time(&mut self, stream: Option<&str>) -> bool {
        let Some(stream) = stream else { return true };
        let seen = self.seen.entry(stream.to_string()).or_default();
        *seen += 1;
        let shown = self.shown.entry(stream.to_string()).or_default();
        if *seen <= *shown {
            return false;
        }
        *shown = *seen;
        self.dirty = true;
        if self.saved.elapsed() >= SAVE_EVERY {
            self.save();
        }
        true
    }

    /// Writes the record (staged, then renamed, so a reader never sees half of it).
    pub fn save(&mut self) {
        if !self.dirty || !self.path.parent().is_some_and(Path::is_dir) {
            return;
        }
        let tmp = self.path.with_extension("json.tmp");
        let ok = serde_json::to_vec(&self.shown).ok().is_some_and(|b| std::fs::write(&tmp, b).is_ok());
        if ok && std::fs::rename(&tmp, &self.path).is_ok() {
            self.dirty = false;
        }
        self.saved = Instant::now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_process_shows_only_the_lines_after_the_first() {
        let dir = tempfile::tempdir().unwrap();
        let mut first = ShownLines::load(dir.path());
        assert!(first.first_time(Some("uid-a/0")));
        assert!(first.first_time(Some("uid-a/0")));
        assert!(first.first_time(Some("uid-b/0")));
        first.save();
        let mut second = ShownLines::load(dir.path());
        assert!(!second.first_time(Some("uid-a/0")));
        assert!(!second.first_time(Some("uid-a/0")));
        assert!(second.first_time(Some("uid-a/0")), "the third line of uid-a is new");
        assert!(!second.first_time(Some("uid-b/0")));
        assert!(second.first_time(Some("uid-a/1")), "a restarted container is a new stream");
        assert!(second.first_time(None));
    }

    #[test]
    fn an_oversized_or_broken_record_shows_everything_again() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(FILE), b"{not json").unwrap();
        assert!(ShownLines::load(dir.path()).first_time(Some("s/0")));
    }
}
