//! Run records: `WORKDIR/runs/<run-id>/` holds the resolved spec, plan.json, run.json (the live
//! state of every stage), mflow.lock (what makes the run reproducible) and per-stage logs,
//! status and metrics.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use crate::cache::key::KeyParts;
use crate::exec::gates::GateResult;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StageStatus {
    Pending,
    Running,
    Cached,
    Succeeded,
    Failed,
    Skipped,
    Cancelled,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RunStatus {
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Attempt {
    pub n: u32,
    pub started: String,
    pub finished: Option<String>,
    pub duration_s: Option<f64>,
    /// "success" or a failure class.
    pub outcome: Option<String>,
    pub message: Option<String>,
    pub log: String,
    pub resumed_from: Option<u64>,
    pub checkpoint_iteration: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StageRecord {
    pub kind: String,
    pub status: StageStatus,
    pub key: Option<String>,
    pub output: Option<String>,
    pub output_digest: Option<String>,
    pub started: Option<String>,
    pub finished: Option<String>,
    pub duration_s: Option<f64>,
    #[serde(default)]
    pub attempts: Vec<Attempt>,
    pub message: Option<String>,
    #[serde(default)]
    pub gates: Vec<GateResult>,
    /// Selected contents of the stage's metrics.json / verification.json.
    #[serde(default)]
    pub metrics: Option<Json>,
    #[serde(default)]
    pub verification: Option<Json>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRecord {
    pub id: String,
    pub pipeline: String,
    pub spec: String,
    pub started: String,
    pub finished: Option<String>,
    pub status: RunStatus,
    pub exit_code: Option<i32>,
    pub mflow_version: String,
    pub stages: BTreeMap<String, StageRecord>,
    /// Stage order as planned.
    pub order: Vec<String>,
}

/// Per stage in the lockfile.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LockedStage {
    pub kind: String,
    pub key: String,
    pub parts: KeyParts,
    pub output_digest: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Lockfile {
    pub version: u32,
    pub mflow_version: String,
    pub pipeline: String,
    pub spec: String,
    pub spec_digest: String,
    pub git_commit: Option<String>,
    pub created: String,
    pub overrides: Vec<String>,
    pub environment: BTreeMap<String, String>,
    pub stages: BTreeMap<String, LockedStage>,
}

pub fn now() -> String {
    jiff::Timestamp::now().round(jiff::Unit::Millisecond).unwrap_or(jiff::Timestamp::now()).to_string()
}

pub fn new_run_id() -> String {
    let t = jiff::Zoned::now();
    format!("{}-{:02x}", t.strftime("%Y%m%d-%H%M%S-%3f"), fastrand::u8(..))
}

/// Writes `bytes` to `path` through a temporary file and a rename. Readers see the old or the
/// new file, never a torn one. No fsync: records are rewritten several times a second, and
/// only cache commits need to survive a power loss.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", fastrand::u32(..)));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    std::fs::rename(&tmp, path)
}

pub fn write_json<T: Serialize>(path: &Path, v: &T) -> std::io::Result<()> {
    write_atomic(path, &serde_json::to_vec_pretty(v).map_err(std::io::Error::other)?)
}

pub fn runs_dir(workdir: &Path) -> PathBuf {
    workdir.join("runs")
}

/// Run ids, oldest first.
pub fn list(workdir: &Path) -> Vec<String> {
    let mut ids: Vec<String> = std::fs::read_dir(runs_dir(workdir))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join("run.json").exists())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    ids.sort();
    ids
}

pub fn load(workdir: &Path, id: &str) -> Option<RunRecord> {
    if !crate::spec::valid_name(&format!("r{id}")) {
        return None;
    }
    let bytes = std::fs::read(runs_dir(workdir).join(id).join("run.json")).ok()?;
    serde_json::from_slice(&bytes).ok()
}

pub fn load_lock(workdir: &Path, id: &str) -> Option<Lockfile> {
    let bytes = std::fs::read(runs_dir(workdir).join(id).join("mflow.lock")).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Resolves "latest" or a unique prefix to a run id.
pub fn resolve(workdir: &Path, id: Option<&str>) -> Option<String> {
    let ids = list(workdir);
    match id {
        None | Some("latest") => ids.last().cloned(),
        Some(p) => {
            let m: Vec<&String> = ids.iter().filter(|i| i.starts_with(p)).collect();
            if m.len() == 1 { Some(m[0].clone()) } else { ids.iter().find(|i| *i == p).cloned() }
        }
    }
}

/// The key parts each stage had when it last ran or was found cached.
pub fn last_keys(workdir: &Path) -> BTreeMap<String, KeyParts> {
    std::fs::read(workdir.join("state").join("keys.json")).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default()
}

/// Merges this run's keys into `last` (as loaded at the start of the run) and writes them back,
/// unless nothing changed: a no-op rerun writes nothing here.
pub fn save_last_keys(workdir: &Path, mut last: BTreeMap<String, KeyParts>, keys: &BTreeMap<String, KeyParts>) {
    let mut changed = false;
    for (name, parts) in keys {
        if last.get(name) != Some(parts) {
            last.insert(name.clone(), parts.clone());
            changed = true;
        }
    }
    if changed {
        let dir = workdir.join("state");
        let _ = std::fs::create_dir_all(&dir);
        let _ = write_json(&dir.join("keys.json"), &last);
    }
}

/// The commit of the git repository holding `dir`, if any (read from .git without running git).
pub fn git_commit(dir: &Path) -> Option<String> {
    let mut cur = Some(dir);
    while let Some(d) = cur {
        let git = d.join(".git");
        if git.is_dir() {
            let head = std::fs::read_to_string(git.join("HEAD")).ok()?;
            let head = head.trim();
            if let Some(r) = head.strip_prefix("ref: ") {
                if let Ok(s) = std::fs::read_to_string(git.join(r)) {
                    return Some(s.trim().to_string());
                }
                let packed = std::fs::read_to_string(git.join("packed-refs")).ok()?;
                return packed.lines().find(|l| l.ends_with(r)).and_then(|l| l.split_whitespace().next()).map(str::to_string);
            }
            return Some(head.to_string());
        }
        cur = d.parent();
    }
    None
}
