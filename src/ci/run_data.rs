//! A recorded run as the CI commands read it: run.json, mflow.lock and each stage's
//! metrics.jsonl (the lines a stage appended to `MFLOW_METRICS`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use super::CiError;
use crate::record::{self, Lockfile, RunRecord, StageRecord, StageStatus};
use crate::workdir::Workdir;

/// Metric lines beyond this many per stage are ignored: a report stays readable and bounded.
const MAX_METRIC_LINES: usize = 200_000;

pub struct RunData {
    pub id: String,
    pub dir: PathBuf,
    pub record: RunRecord,
    pub lock: Option<Lockfile>,
    /// Stage -> its metrics.jsonl lines (JSON objects), in file order.
    pub series: BTreeMap<String, Vec<Json>>,
}

impl RunData {
    /// `run` is an id, a unique prefix, or None / "latest".
    pub fn load(workdir: &Workdir, run: Option<&str>) -> Result<RunData, CiError> {
        let id = record::resolve(workdir, run).ok_or_else(|| CiError::NoRun {
            run: run.unwrap_or("latest").to_string(),
            workdir: workdir.root().to_path_buf(),
        })?;
        let record = record::load(workdir, &id)
            .ok_or_else(|| CiError::DamagedRun { run: id.clone(), file: "run.json".into() })?;
        Ok(RunData::of(record, workdir))
    }

    /// A run of `workdir` whose record is at hand, with the rest read from its directory.
    pub fn of(record: RunRecord, workdir: &Workdir) -> RunData {
        let id = record.id.clone();
        let dir = workdir.run(&id);
        let lock = record::load_lock(workdir, &id);
        let series = record
            .order
            .iter()
            .filter(|n| crate::spec::valid_name(n))
            .map(|n| (n.clone(), read_series(&crate::workdir::stage_dir(&dir, n).join("metrics.jsonl"))))
            .collect();
        RunData { id, dir, record, lock, series }
    }

    /// Stages in planned order with their records.
    pub fn stages(&self) -> impl Iterator<Item = (&String, &StageRecord)> {
        self.record.order.iter().filter_map(|n| self.record.stages.get(n).map(|s| (n, s)))
    }

    /// The last attempt's log of a stage, if it ran here.
    pub fn log_path(&self, stage: &str) -> Option<PathBuf> {
        let s = self.record.stages.get(stage)?;
        let a = s.attempts.last()?;
        let p = self.dir.join(&a.log);
        // The record is data from disk: keep the path inside the run directory.
        (!a.log.contains("..") && !Path::new(&a.log).is_absolute()).then_some(p)
    }

    /// Final values of every numeric metric, per stage: the stage record's `metrics` (flattened
    /// with dotted keys) and the last value of each key in metrics.jsonl.
    pub fn final_metrics(&self) -> BTreeMap<String, BTreeMap<String, f64>> {
        let mut out = BTreeMap::new();
        for (name, s) in self.stages() {
            let mut m = BTreeMap::new();
            for line in self.series.get(name).into_iter().flatten() {
                if let Some(o) = line.as_object() {
                    for (k, v) in o {
                        if let Some(x) = v.as_f64() {
                            if k != "iteration" && x.is_finite() {
                                m.insert(k.clone(), x);
                            }
                        }
                    }
                }
            }
            if let Some(metrics) = &s.metrics {
                flatten("", metrics, &mut m);
            }
            if !m.is_empty() {
                out.insert(name.clone(), m);
            }
        }
        out
    }
}

fn flatten(prefix: &str, v: &Json, out: &mut BTreeMap<String, f64>) {
    match v {
        Json::Object(o) => {
            for (k, v) in o {
                let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                flatten(&key, v, out);
            }
        }
        Json::Number(n) => {
            if let Some(x) = n.as_f64().filter(|x| x.is_finite()) {
                out.insert(prefix.to_string(), x);
            }
        }
        _ => {}
    }
}

/// The JSON objects of a stage's metrics.jsonl, in order, up to a cap.
pub fn read_series(path: &Path) -> Vec<Json> {
    use std::io::{BufRead, Read};
    // Written by the stage: opened as the one reader of such files does, and read line by line
    // up to a cap rather than whole.
    let Ok(f) = mflow_untrusted::open_regular(path) else { return vec![] };
    let lines = std::io::BufReader::new(f.take(crate::untrusted::METRICS_LOG)).split(b'\n').map_while(Result::ok);
    lines
        .filter_map(|l| serde_json::from_slice::<Json>(&l).ok())
        .filter(Json::is_object)
        .take(MAX_METRIC_LINES)
        .collect()
}

/// The last `n` lines of a file, with at most `max_bytes` read from its end.
pub fn tail(path: &Path, n: usize, max_bytes: u64) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = mflow_untrusted::open_regular(path) else { return String::new() };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(max_bytes);
    if f.seek(SeekFrom::Start(start)).is_err() {
        return String::new();
    }
    let mut buf = Vec::new();
    let _ = f.take(max_bytes).read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let lines: Vec<&str> = text.lines().collect();
    // A cut at `start` may split the first line; drop it unless it is the file's start.
    let skip = usize::from(start > 0 && lines.len() > 1);
    let from = lines.len().saturating_sub(n).max(skip);
    lines[from..].join("\n")
}

/// The stage's wall time: recorded for stages that finished, else the sum of its attempts
/// (failed stages), else None.
pub fn stage_duration(s: &StageRecord) -> Option<f64> {
    s.duration_s.or_else(|| {
        let times: Vec<f64> = s.attempts.iter().filter_map(|a| a.duration_s).collect();
        (!times.is_empty()).then(|| times.iter().fold(0.0, |a, b| a + b))
    })
}

pub fn status_word(s: StageStatus) -> &'static str {
    match s {
        StageStatus::Pending => "pending",
        StageStatus::Running => "running",
        StageStatus::Cached => "cached",
        StageStatus::Succeeded => "succeeded",
        StageStatus::Failed => "failed",
        StageStatus::Skipped => "skipped",
        StageStatus::Cancelled => "cancelled",
        StageStatus::Interrupted => "interrupted",
    }
}

/// Durations as people read them: 0.4s, 12.3s, 4m05s, 1h02m.
pub fn human_duration(s: Option<f64>) -> String {
    match s {
        None => "-".into(),
        Some(s) if s < 60.0 => format!("{s:.1}s"),
        Some(s) if s < 3600.0 => format!("{}m{:02}s", (s / 60.0) as u64, (s % 60.0) as u64),
        Some(s) => format!("{}h{:02}m", (s / 3600.0) as u64, ((s % 3600.0) / 60.0) as u64),
    }
}
