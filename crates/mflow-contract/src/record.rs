//! run.json: the record of one run, every stage and attempt. A record is the fold of the run's
//! events ([`RunRecord::apply`]): the engine emits events and the record follows from them, so
//! the record, the console and every machine format say the same thing.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use crate::event::{Counts, RunEvent};
use crate::FailureClass;

/// The format of run.json, in its `format` field. Records written before the field existed
/// read as format 0 (their failure class is the prefix of the stage's message).
pub const FORMAT: u32 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum StageStatus {
    Pending,
    Running,
    Cached,
    Succeeded,
    Failed,
    Skipped,
    Cancelled,
    /// mflow was interrupted (SIGTERM, SIGHUP) while the stage ran on a cluster; its TrainJob
    /// was left running and the next run reattaches to it.
    Interrupted,
}

impl StageStatus {
    pub fn as_str(self) -> &'static str {
        match self {
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RunStatus {
    Running,
    Succeeded,
    Failed,
    Cancelled,
    /// Stopped by a signal that ends mflow (SIGTERM, SIGHUP, ...): cluster work was left
    /// running for the next run.
    Interrupted,
}

impl RunStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Running => "running",
            RunStatus::Succeeded => "succeeded",
            RunStatus::Failed => "failed",
            RunStatus::Cancelled => "cancelled",
            RunStatus::Interrupted => "interrupted",
        }
    }
}

/// How an attempt ended: `"success"`, `"interrupted"`, or its failure class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptOutcome {
    Success,
    Interrupted,
    Failed(FailureClass),
}

impl AttemptOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptOutcome::Success => "success",
            AttemptOutcome::Interrupted => "interrupted",
            AttemptOutcome::Failed(c) => c.as_str(),
        }
    }

    pub fn parse(s: &str) -> Option<AttemptOutcome> {
        match s {
            "success" => Some(AttemptOutcome::Success),
            "interrupted" => Some(AttemptOutcome::Interrupted),
            c => FailureClass::parse(c).map(AttemptOutcome::Failed),
        }
    }
}

impl Serialize for AttemptOutcome {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for AttemptOutcome {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        AttemptOutcome::parse(&s).ok_or_else(|| serde::de::Error::custom(format!("unknown attempt outcome {s:?}")))
    }
}

impl std::fmt::Display for AttemptOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// As in [`StageRecord`], what is not known is left out; records written with nulls still read.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Attempt {
    pub n: u32,
    pub started: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<AttemptOutcome>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Where the attempt's log goes, relative to the run's directory; the file is made at the
    /// attempt's first line.
    pub log: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_iteration: Option<u64>,
}

/// The result of one gate: `metric condition` against the stage's metrics.json.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct GateResult {
    pub metric: String,
    pub condition: String,
    pub value: Option<f64>,
    pub passed: bool,
}

/// The engine a train or evaluate stage (or an export's verification) runs with, and why, in
/// words. Only `name` enters the cache key: the reason counts this machine's GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct EngineChoice {
    pub name: String,
    pub reason: String,
}

impl std::fmt::Display for EngineChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "engine {} ({})", self.name, self.reason)
    }
}

/// What is not known (yet) is left out of run.json rather than written as null: a record of a
/// large run is mostly stages that never started.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StageRecord {
    pub kind: String,
    pub status: StageStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attempts: Vec<Attempt>,
    /// Why the stage failed, was skipped, cancelled or interrupted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The class of the failure of a failed or cancelled stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<FailureClass>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gates: Vec<GateResult>,
    /// Selected contents of the stage's metrics.json / verification.json.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<Json>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verification: Option<Json>,
    /// The engine of a train or evaluate stage (an export's verification) and why it was
    /// chosen; for a cached stage, the engine its key names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineChoice>,
}

impl StageRecord {
    pub fn pending(kind: &str, engine: Option<EngineChoice>) -> StageRecord {
        StageRecord {
            kind: kind.to_string(),
            status: StageStatus::Pending,
            key: None,
            output: None,
            output_digest: None,
            started: None,
            finished: None,
            duration_s: None,
            attempts: vec![],
            message: None,
            class: None,
            gates: vec![],
            metrics: None,
            verification: None,
            engine,
        }
    }

    /// The failure in words, as the console shows it: `class: message`.
    pub fn failure(&self) -> Option<String> {
        let message = self.message.as_deref()?;
        Some(match self.class {
            Some(c) => format!("{c}: {message}"),
            None => message.to_string(),
        })
    }
}

/// The process that runs a run: with its host and start, whether it still runs can be told after
/// it was killed outright (a record it could not finish says `running` for ever).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunProcess {
    pub host: String,
    pub pid: u32,
    /// Clock ticks after boot at which the process started (with the pid, it names the process
    /// even after its pid is reused).
    pub start: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRecord {
    /// The format of this record ([`FORMAT`]); 0 for records older than the field.
    #[serde(default)]
    pub format: u32,
    pub id: String,
    pub pipeline: String,
    pub spec: String,
    pub started: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished: Option<String>,
    pub status: RunStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    pub mflow_version: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process: Option<RunProcess>,
    pub stages: BTreeMap<String, StageRecord>,
    /// Stage order as planned.
    pub order: Vec<String>,
}

impl RunRecord {
    /// A record read from a file: records of format 0 kept the failure class as the prefix
    /// of the message (`"user: ..."`); it becomes the typed field here.
    pub fn upgraded(mut self) -> RunRecord {
        if self.format == 0 {
            for s in self.stages.values_mut() {
                let Some(m) = s.message.as_deref() else { continue };
                if let Some((class, rest)) =
                    FailureClass::ALL.iter().find_map(|c| Some((*c, m.strip_prefix(c.as_str())?.strip_prefix(": ")?)))
                {
                    s.class = Some(class);
                    s.message = Some(rest.to_string());
                }
            }
        }
        self
    }

    /// Stages by status.
    pub fn counts(&self) -> Counts {
        let n = |st: StageStatus| self.stages.values().filter(|s| s.status == st).count();
        Counts {
            ran: n(StageStatus::Succeeded),
            cached: n(StageStatus::Cached),
            failed: n(StageStatus::Failed),
            skipped: n(StageStatus::Skipped) + n(StageStatus::Cancelled),
            interrupted: n(StageStatus::Interrupted),
        }
    }

    /// Every gate of every stage, in the order of stage names.
    pub fn gates(&self) -> Vec<(String, GateResult)> {
        self.stages.iter().flat_map(|(name, s)| s.gates.iter().map(move |g| (name.clone(), g.clone()))).collect()
    }

    /// Applies one event; `time` gives when it happened (RFC 3339), and is asked only by the
    /// events that record a time.
    pub fn apply(&mut self, time: &dyn Fn() -> String, ev: &RunEvent) {
        match ev {
            RunEvent::RunStarted { pipeline, spec, stages, process, .. } => {
                self.process = process.clone();
                self.pipeline = pipeline.clone();
                self.spec = spec.clone();
                self.started = time();
                self.order = stages.iter().map(|s| s.name.clone()).collect();
                self.stages =
                    stages.iter().map(|s| (s.name.clone(), StageRecord::pending(&s.kind, s.engine.clone()))).collect();
            }
            RunEvent::RunFinished { status, exit_code, .. } => {
                self.status = *status;
                self.exit_code = Some(*exit_code);
                self.finished = Some(time());
            }
            _ => {
                if let Some(stage) = ev.stage().and_then(|s| self.stages.get_mut(s)) {
                    apply_to_stage(stage, time, ev);
                }
            }
        }
    }
}

fn apply_to_stage(r: &mut StageRecord, time: &dyn Fn() -> String, ev: &RunEvent) {
    match ev {
        RunEvent::StageCached { key, output, digest, .. } => {
            r.status = StageStatus::Cached;
            r.key = Some(key.clone());
            r.output = Some(output.clone());
            r.output_digest = Some(digest.clone());
        }
        RunEvent::StageSkipped { reason, .. } => {
            r.status = StageStatus::Skipped;
            r.message = Some(reason.clone());
        }
        RunEvent::StageCancelled { .. } => r.status = StageStatus::Cancelled,
        RunEvent::StageStarted { key, .. } => {
            r.status = StageStatus::Running;
            r.key = Some(key.clone());
            r.started = Some(time());
        }
        RunEvent::AttemptStarted { attempt, log, resumed_from, .. } => r.attempts.push(Attempt {
            n: *attempt,
            started: time(),
            finished: None,
            duration_s: None,
            outcome: None,
            message: None,
            log: log.clone(),
            resumed_from: *resumed_from,
            checkpoint_iteration: None,
        }),
        RunEvent::AttemptEnded { end, .. } => {
            if let Some(a) = r.attempts.last_mut() {
                a.finished = Some(time());
                a.duration_s = Some(end.duration_s);
                a.outcome = Some(end.outcome);
                a.message = end.message.clone();
                a.checkpoint_iteration = end.checkpoint_iteration;
                if end.resumed_from.is_some() {
                    a.resumed_from = end.resumed_from;
                }
            }
            r.metrics = end.metrics.clone();
            r.verification = end.verification.clone();
        }
        RunEvent::GatesChecked { gates, metrics, .. } => {
            r.gates = gates.clone();
            if r.metrics.is_none() {
                r.metrics = metrics.clone();
            }
        }
        RunEvent::StageSucceeded { output, digest, duration_s, .. } => {
            r.status = StageStatus::Succeeded;
            r.output = Some(output.clone());
            r.output_digest = Some(digest.clone());
            r.finished = Some(time());
            r.duration_s = Some(*duration_s);
        }
        RunEvent::StageFailed { class, message, .. } => {
            r.status = if *class == FailureClass::Cancelled { StageStatus::Cancelled } else { StageStatus::Failed };
            r.class = Some(*class);
            r.message = Some(message.clone());
            let finished = time();
            // A stage whose gate failed keeps the duration it succeeded with.
            if r.duration_s.is_none() {
                r.duration_s = r.started.as_deref().and_then(|s| seconds_between(s, &finished));
            }
            r.finished = Some(finished);
        }
        RunEvent::StageInterrupted { message, .. } => {
            r.status = StageStatus::Interrupted;
            r.message = Some(message.clone());
        }
        RunEvent::RunStarted { .. }
        | RunEvent::StageKeyed { .. }
        | RunEvent::Output { .. }
        | RunEvent::Progress { .. }
        | RunEvent::Warning { .. }
        | RunEvent::RunFinished { .. } => {}
    }
}

/// Seconds from `from` to `to`, both RFC 3339 times in UTC as the engine stamps them
/// (`2026-12-04T00:00:01.250Z`); None for any other form.
fn seconds_between(from: &str, to: &str) -> Option<f64> {
    Some((utc_seconds(to)? - utc_seconds(from)?).max(0.0))
}

fn utc_seconds(t: &str) -> Option<f64> {
    let t = t.strip_suffix('Z')?;
    let (date, time) = t.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|x| x.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let mut c = time.splitn(3, ':');
    let (h, min) = (c.next()?.parse::<i64>().ok()?, c.next()?.parse::<i64>().ok()?);
    let s = c.next()?.parse::<f64>().ok().filter(|s| s.is_finite())?;
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm), 1970-01-01 being day 0.
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((days * 86_400 + h * 3600 + min * 60) as f64 + s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_fields_are_left_out_and_older_records_with_nulls_still_read() {
        let a = Attempt {
            n: 1,
            started: "2026-12-04T00:00:00Z".into(),
            finished: None,
            duration_s: None,
            outcome: None,
            message: None,
            log: "stages/a/attempt-1.log".into(),
            resumed_from: None,
            checkpoint_iteration: None,
        };
        let text = serde_json::to_string(&a).unwrap();
        assert!(!text.contains("null"), "{text}");
        let old = r#"{"n": 1, "started": "t", "finished": null, "duration_s": null, "outcome": null,
            "message": null, "log": "l", "resumed_from": null, "checkpoint_iteration": null}"#;
        let read: Attempt = serde_json::from_str(old).unwrap();
        assert!(read.message.is_none() && read.outcome.is_none());
        let run = r#"{"id": "r", "pipeline": "p", "spec": "s", "started": "t", "finished": null,
            "status": "running", "exit_code": null, "mflow_version": "0", "stages": {}, "order": []}"#;
        let r: RunRecord = serde_json::from_str(run).unwrap();
        assert!(r.finished.is_none() && r.exit_code.is_none());
        assert!(!serde_json::to_string(&r).unwrap().contains("null"));
    }

    #[test]
    fn times_are_subtracted_across_days_and_months() {
        assert_eq!(seconds_between("2026-12-04T00:00:00Z", "2026-12-04T00:00:01.250Z"), Some(1.25));
        assert_eq!(seconds_between("2024-02-28T23:59:59Z", "2024-03-01T00:00:00Z"), Some(86_401.0));
        assert_eq!(seconds_between("1999-12-31T23:00:00Z", "2000-01-01T01:00:00Z"), Some(7200.0));
        assert_eq!(utc_seconds("1970-01-01T00:00:00Z"), Some(0.0));
        assert_eq!(seconds_between("2026-12-04T00:00:00+01:00", "2026-12-04T00:00:01Z"), None);
    }
}
