//! Run records: `WORKDIR/runs/<run-id>/` holds the resolved spec, plan.json, run.json (the live
//! state of every stage), mflow.lock (what makes the run reproducible) and per-stage logs,
//! status and metrics.

mod lines;
pub mod lock;
pub mod start;
pub mod writer;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::cache::key::KeyParts;
use crate::workdir::Workdir;

pub use mflow_contract::lock::{LockedStage, Lockfile};
pub use mflow_contract::record::{
    Attempt, AttemptOutcome, EngineChoice, GateResult, RunRecord, RunStatus, StageRecord, StageStatus,
};

pub fn now() -> String {
    jiff::Timestamp::now().round(jiff::Unit::Millisecond).unwrap_or(jiff::Timestamp::now()).to_string()
}

/// UTC, so that ids sort by start time across daylight-saving changes (and no time zone
/// database is read).
pub fn new_run_id() -> String {
    let t = jiff::Timestamp::now();
    format!("{}-{:02x}", t.strftime("%Y%m%d-%H%M%S-%3f"), fastrand::u8(..))
}

/// The id of a new run in `workdir`: `MFLOW_RUN_ID` when a driver started from outside the
/// cluster names it (`<id>.2`, `<id>.3`, ... when the driver restarted), else a fresh one.
pub fn run_id_for(workdir: &Workdir) -> String {
    let given = std::env::var("MFLOW_RUN_ID").ok().filter(|id| is_run_id(id));
    let Some(id) = given else { return new_run_id() };
    if !workdir.run(&id).exists() {
        return id;
    }
    (2..).map(|n| format!("{id}.{n}")).find(|c| !workdir.run(c).exists()).expect("a free restart number")
}

/// Ids name directories and label values: ASCII letters, digits, `-` and `.`, at most 48.
pub fn is_run_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 48
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        && !id.starts_with('.')
}

/// Writes `bytes` to `path` through a temporary file and a rename. Readers see the old or the
/// new file, never a torn one. No fsync: records are rewritten several times a second, and
/// only cache commits need to survive a power loss.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_with(path, |w| w.write_all(bytes))
}

/// Streams `v` as JSON to `path` (atomically, as `write_atomic`) without building it in memory
/// first: a record of a large run is megabytes.
pub fn write_json<T: Serialize>(path: &Path, v: &T) -> std::io::Result<()> {
    write_with(path, |w| {
        v.serialize(&mut serde_json::Serializer::with_formatter(w, lines::Lines::default()))
            .map_err(std::io::Error::other)
    })
}

fn write_with(
    path: &Path,
    write: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", fastrand::u32(..)));
    let mut w = std::io::BufWriter::with_capacity(64 << 10, std::fs::File::create(&tmp)?);
    let written = write(&mut w).and_then(|()| w.flush());
    drop(w);
    match written.and_then(|()| std::fs::rename(&tmp, path)) {
        Ok(()) => Ok(()),
        Err(e) => {
            // Nothing half-written stays behind.
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Run ids, oldest first.
pub fn list(workdir: &Workdir) -> Vec<String> {
    let mut ids: Vec<String> = std::fs::read_dir(workdir.runs())
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join("run.json").exists())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    ids.sort();
    ids
}

pub fn load(workdir: &Workdir, id: &str) -> Option<RunRecord> {
    if !crate::spec::valid_name(&format!("r{id}")) {
        return None;
    }
    let bytes = crate::cache::read_regular(&workdir.run(id).join("run.json"), crate::cache::MAX_STATE_BYTES).ok()?;
    serde_json::from_slice::<RunRecord>(&bytes).ok().map(RunRecord::upgraded)
}

pub fn load_lock(workdir: &Workdir, id: &str) -> Option<Lockfile> {
    let bytes = crate::cache::read_regular(&workdir.run(id).join("mflow.lock"), crate::cache::MAX_STATE_BYTES).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Resolves "latest" or a unique prefix to a run id.
pub fn resolve(workdir: &Workdir, id: Option<&str>) -> Option<String> {
    let ids = list(workdir);
    match id {
        None | Some("latest") => ids.last().cloned(),
        Some(p) => {
            let m: Vec<&String> = ids.iter().filter(|i| i.starts_with(p)).collect();
            if m.len() == 1 {
                Some(m[0].clone())
            } else {
                ids.iter().find(|i| *i == p).cloned()
            }
        }
    }
}

/// The key parts each stage of a pipeline had when it last ran or was found cached
/// (`state/keys-PIPELINE.json`, for `mflow why` and the reasons in a plan): per pipeline, since
/// specs beside each other share a workdir and their stages' names. They are read only when
/// asked for: a no-op rerun compares its keys with `state/keys-PIPELINE.index` (one `stage key`
/// line each) and reads nothing else.
pub struct LastKeys {
    json: PathBuf,
    index: PathBuf,
    parts: std::sync::OnceLock<BTreeMap<String, KeyParts>>,
}

impl LastKeys {
    /// `pipeline` is a valid pipeline name (`crate::spec::valid_name`): a file name.
    pub fn open(workdir: &Workdir, pipeline: &str) -> LastKeys {
        LastKeys {
            json: workdir.state_file(&format!("keys-{pipeline}.json")),
            index: workdir.state_file(&format!("keys-{pipeline}.index")),
            parts: std::sync::OnceLock::new(),
        }
    }

    pub fn get(&self, stage: &str) -> Option<&KeyParts> {
        self.all().get(stage)
    }

    fn all(&self) -> &BTreeMap<String, KeyParts> {
        self.parts.get_or_init(|| load_keys(&self.json))
    }

    /// Merges this run's keys (stage -> key and parts) into the saved ones, unless every stage
    /// kept its key: a no-op rerun writes nothing here.
    pub fn save(self, keys: &BTreeMap<String, (String, std::sync::Arc<KeyParts>)>) {
        let index = crate::cache::read_regular(&self.index, crate::cache::MAX_STATE_BYTES)
            .ok()
            .and_then(|b| String::from_utf8(b).ok())
            .unwrap_or_default();
        let saved: std::collections::HashMap<&str, &str> = index.lines().filter_map(|l| l.split_once(' ')).collect();
        if keys.iter().all(|(name, (key, _))| saved.get(name.as_str()) == Some(&key.as_str())) {
            return;
        }
        let LastKeys { json, index, parts } = self;
        let mut all = parts.into_inner().unwrap_or_else(|| load_keys(&json));
        for (name, (_, parts)) in keys {
            all.insert(name.clone(), KeyParts::clone(parts));
        }
        if let Some(dir) = json.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        // The parts first: an index older than them only causes one more merge.
        if write_json(&json, &all).is_ok() {
            let lines: String = all.iter().map(|(name, parts)| format!("{name} {}\n", parts.key())).collect();
            let _ = write_atomic(&index, lines.as_bytes());
        }
    }
}

fn load_keys(json: &Path) -> BTreeMap<String, KeyParts> {
    crate::cache::read_regular(json, crate::cache::MAX_STATE_BYTES)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// The commit of the git repository holding `dir`, if any (read from .git without running git;
/// only a commit id ever comes out: `mflow_untrusted::git`).
pub fn git_commit(dir: &Path) -> Option<String> {
    crate::untrusted::git::commit_of(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(salt: &str) -> KeyParts {
        KeyParts {
            kind: "command".into(),
            kind_version: 1,
            params: std::sync::Arc::new(serde_json::json!({"run": ["true"]})),
            upstream: BTreeMap::new(),
            inputs: Default::default(),
            workload: String::new(),
            environment: String::new(),
            salt: salt.into(),
        }
    }

    fn keyed(stages: &[(&str, &str)]) -> BTreeMap<String, (String, std::sync::Arc<KeyParts>)> {
        stages
            .iter()
            .map(|(name, salt)| (name.to_string(), (parts(salt).key(), std::sync::Arc::new(parts(salt)))))
            .collect()
    }

    #[test]
    fn last_keys_are_merged_and_a_run_with_the_same_keys_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let keys_json = Workdir::new(dir.path()).state_file("keys-p.json");
        LastKeys::open(&Workdir::new(dir.path()), "p").save(&keyed(&[("a", ""), ("b", "")]));
        assert_eq!(LastKeys::open(&Workdir::new(dir.path()), "p").get("a"), Some(&parts("")));

        // Same keys: keys.json is not read or written (removing it proves the second).
        std::fs::remove_file(&keys_json).unwrap();
        LastKeys::open(&Workdir::new(dir.path()), "p").save(&keyed(&[("a", "")]));
        assert!(!keys_json.exists());

        // A changed key is merged with the stages this run did not touch.
        LastKeys::open(&Workdir::new(dir.path()), "p").save(&keyed(&[("a", "")]));
        LastKeys::open(&Workdir::new(dir.path()), "p").save(&keyed(&[("a", "x")]));
        let last = LastKeys::open(&Workdir::new(dir.path()), "p");
        assert_eq!(last.get("a"), Some(&parts("x")));
        assert_eq!(last.get("b"), None, "b was lost with the removed keys.json, and not invented");
        let index = std::fs::read_to_string(Workdir::new(dir.path()).state_file("keys-p.index")).unwrap();
        assert_eq!(index, format!("a {}\n", parts("x").key()));
    }

    #[test]
    fn a_missing_index_merges_again() {
        let dir = tempfile::tempdir().unwrap();
        LastKeys::open(&Workdir::new(dir.path()), "p").save(&keyed(&[("a", ""), ("b", "")]));
        std::fs::remove_file(Workdir::new(dir.path()).state_file("keys-p.index")).unwrap();
        LastKeys::open(&Workdir::new(dir.path()), "p").save(&keyed(&[("a", "")]));
        let index = std::fs::read_to_string(Workdir::new(dir.path()).state_file("keys-p.index")).unwrap();
        assert_eq!(index.lines().count(), 2);
        assert_eq!(LastKeys::open(&Workdir::new(dir.path()), "p").get("b"), Some(&parts("")));
    }

    #[test]
    fn a_failed_write_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("sub");
        std::fs::create_dir(&target).unwrap();
        // Renaming a file over a non-empty directory fails after the temporary file was written.
        std::fs::write(target.join("x"), b"").unwrap();
        assert!(write_json(&target, &serde_json::json!({"a": 1})).is_err());
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("sub")]);
    }
}
