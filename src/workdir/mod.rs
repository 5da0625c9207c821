//! A workdir: mflow's own directory for a spec, holding its cache, run records, state and the
//! scratch space of stages. [`Workdir`] hands out every path of its layout; no other code
//! spells them.
//!
//! ```text
//! WORKDIR/
//!   .mflow-workdir                  the marker (own.rs)
//!   cache/<key>/                    committed outputs
//!   cache/.manifests.jsonl          one manifest line per committed entry
//!   cache/.lock                     the key locks and the lock of live runs
//!   cache/.staging/<key>.<run>/out  an attempt's output while it runs (its reports beside it)
//!   cache/.kube/<trainjob>/out      the same for an attempt that runs as a TrainJob: named
//!                                   after it, so that a restarted mflow finds it again
//!   cache/.trash/, cache/.unverified/
//!   scratch/<key>/                  what survives a failed attempt (checkpoints)
//!   runs/<id>/                      a run's record; runs/<id>/stages/<stage>/ its attempts
//!   runs/rendered/                  the objects `mflow render` shows
//!   state/                          keys, input stats, the last record files written
//! ```

mod own;

pub use own::{claim, inspect, resolve, Found, Refusal, MARKER};

use std::path::{Path, PathBuf};

const CACHE: &str = "cache";
const SCRATCH: &str = "scratch";
const RUNS: &str = "runs";
const STATE: &str = "state";
const STAGES: &str = "stages";
const STAGING: &str = ".staging";
const KUBE: &str = ".kube";
/// The output directory inside an attempt's staging directory.
const OUT: &str = "out";

/// The directories below a workdir that mflow writes into (a link there must not lead into the
/// system).
pub const WRITTEN: [&str; 4] = [CACHE, RUNS, STATE, SCRATCH];

/// Files of older workdirs without the marker, relative to the workdir.
pub const OLDER_LAYOUT: [&str; 5] =
    ["cache/.manifests.jsonl", "cache/.lock", "state/inputs.json", "state/keys.json", "state/keys.index"];

/// Where one attempt's output goes, known before its job is built (the backend says which).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AttemptArea {
    /// The attempt's directory: its output, and the files the stage writes about itself
    /// (status, progress, metrics) beside it.
    pub dir: PathBuf,
    /// The output directory (`MFLOW_OUTPUT`), inside `dir`; it becomes the cache entry.
    pub out: PathBuf,
    /// The attempt can outlive this mflow process and be reattached to by the next (a
    /// TrainJob): its area is the backend's to prepare, and it is kept while the attempt goes
    /// on without mflow. An area that is not is the engine's, made afresh for each attempt.
    pub reattachable: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Workdir {
    root: PathBuf,
}

impl Workdir {
    pub fn new(root: impl Into<PathBuf>) -> Workdir {
        Workdir { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn display(&self) -> std::path::Display<'_> {
        self.root.display()
    }

    /// Whether this workdir lies under `dir`.
    pub fn starts_with(&self, dir: impl AsRef<Path>) -> bool {
        self.root.starts_with(dir)
    }

    pub fn marker(&self) -> PathBuf {
        self.root.join(MARKER)
    }

    /// The cache: committed entries by key, and mflow's files about them.
    pub fn cache(&self) -> PathBuf {
        self.root.join(CACHE)
    }

    /// The committed output of `key`.
    pub fn entry(&self, key: &str) -> PathBuf {
        self.cache().join(key)
    }

    pub fn manifest_log(&self) -> PathBuf {
        self.cache().join(".manifests.jsonl")
    }

    pub fn cache_lock(&self) -> PathBuf {
        self.cache().join(".lock")
    }

    /// Where entries go on their way out (removed in the background).
    pub fn trash(&self) -> PathBuf {
        self.cache().join(".trash")
    }

    /// Where entries that nothing vouches for are set aside for a person to look at.
    pub fn unverified(&self) -> PathBuf {
        self.cache().join(".unverified")
    }

    /// The staging area: one directory per attempt.
    pub fn staging_area(&self) -> PathBuf {
        self.cache().join(STAGING)
    }

    /// The directory of attempt `<key>.<run>` in the staging area.
    pub fn staging_attempt(&self, key: &str, run: &str) -> PathBuf {
        self.staging_area().join(format!("{key}.{run}"))
    }

    /// The output directory (`MFLOW_OUTPUT`) of attempt `<key>.<run>`.
    pub fn staging(&self, key: &str, run: &str) -> PathBuf {
        self.staging_attempt(key, run).join(OUT)
    }

    /// The area of attempt `<key>.<run>` in the staging area: the engine's own.
    pub fn staged_attempt(&self, key: &str, run: &str) -> AttemptArea {
        AttemptArea { dir: self.staging_attempt(key, run), out: self.staging(key, run), reattachable: false }
    }

    /// Where TrainJobs keep their attempts' areas.
    pub fn trainjob_area(&self) -> PathBuf {
        self.cache().join(KUBE)
    }

    /// The area of the attempt that runs as TrainJob `name`: named after it, so that an mflow
    /// that restarts finds what it wrote.
    pub fn trainjob_attempt(&self, name: &str) -> AttemptArea {
        let dir = self.trainjob_area().join(name);
        AttemptArea { out: dir.join(OUT), dir, reattachable: true }
    }

    /// The attempt directory that holds the output `out` of an attempt's area, when `out` is
    /// one (in the staging area or a TrainJob's).
    pub fn attempt_of<'a>(&self, out: &'a Path) -> Option<&'a Path> {
        let attempt = out.parent()?;
        let area = attempt.parent()?;
        (out.file_name()? == OUT && (area == self.staging_area() || area == self.trainjob_area())).then_some(attempt)
    }

    /// Where the stage of `key` keeps what must survive a failed attempt.
    pub fn scratch(&self, key: &str) -> PathBuf {
        self.root.join(SCRATCH).join(key)
    }

    /// The note a failed attempt of `key` leaves about its newest checkpoint.
    pub fn resume_note(&self, key: &str) -> PathBuf {
        self.scratch(key).join("progress.json")
    }

    /// The newest checkpoint iteration a failed attempt of `key` left behind, if any.
    pub fn resume_point(&self, key: &str) -> Option<u64> {
        // The stage's scratch directory is its own: the note may be anything by now.
        let v = crate::untrusted::read_json(&self.resume_note(key), crate::untrusted::SMALL_JSON)?;
        v.get("checkpoint_iteration")?.as_u64()
    }

    pub fn runs(&self) -> PathBuf {
        self.root.join(RUNS)
    }

    /// The record directory of run `id`.
    pub fn run(&self, id: &str) -> PathBuf {
        self.runs().join(id)
    }

    /// Where `mflow render` puts what it renders, as a run's record would hold it.
    pub fn rendered(&self) -> PathBuf {
        self.runs().join("rendered")
    }

    pub fn state(&self) -> PathBuf {
        self.root.join(STATE)
    }

    /// A file of the workdir's state.
    pub fn state_file(&self, name: &str) -> PathBuf {
        self.state().join(name)
    }
}

/// The directory holding the attempts of `stage` in the record directory `run_dir` of a run
/// (its logs, configs and reports).
pub fn stage_dir(run_dir: &Path, stage: &str) -> PathBuf {
    run_dir.join(STAGES).join(stage)
}

/// The directory holding every stage's attempts in the record directory `run_dir`.
pub fn stages_dir(run_dir: &Path) -> PathBuf {
    run_dir.join(STAGES)
}

impl AsRef<Path> for Workdir {
    fn as_ref(&self) -> &Path {
        &self.root
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attempts_output_is_known_by_its_area() {
        let w = Workdir::new("/w");
        let staged = w.staged_attempt("k", "r");
        assert_eq!(staged.out, Path::new("/w/cache/.staging/k.r/out"));
        assert_eq!(w.attempt_of(&staged.out), Some(staged.dir.as_path()));
        assert!(!staged.reattachable);
        let trainjob = w.trainjob_attempt("p-s-k");
        assert_eq!(trainjob.out, Path::new("/w/cache/.kube/p-s-k/out"));
        assert_eq!(w.attempt_of(&trainjob.out), Some(trainjob.dir.as_path()));
        assert!(trainjob.reattachable);
        assert_eq!(w.attempt_of(Path::new("/w/cache/k/out")), None);
        assert_eq!(w.attempt_of(Path::new("/w/cache/.kube/p-s-k/other")), None);
    }
}
