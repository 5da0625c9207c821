//! The run event: what a run emits as it goes. The engine emits nothing else; the run record
//! (a fold of the events, [`crate::record::RunRecord::apply`]), the console, the JSON lines of
//! `--output-format json`, JUnit, the CI step summary and the follower of a run in a cluster all
//! read these events.

use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use crate::record::{AttemptOutcome, EngineChoice, GateResult, RunStatus};
use crate::FailureClass;

/// The format of an event line, in its `v` field. A reader refuses a newer major format.
pub const FORMAT: u32 = 1;

/// One line of the JSON event stream: an event with the run it belongs to and when it
/// happened (RFC 3339, UTC).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EventLine {
    pub v: u32,
    pub run: String,
    pub time: String,
    #[serde(flatten)]
    pub event: RunEvent,
}

/// A stage as the run starts: its name, kind and the engine chosen for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannedStage {
    pub name: String,
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineChoice>,
}

/// The retry that follows a failed attempt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Retry {
    /// The number of the next attempt.
    pub attempt: u32,
    /// Seconds until it starts.
    pub after_s: f64,
}

/// How an attempt ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptEnd {
    pub outcome: AttemptOutcome,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    pub duration_s: f64,
    /// The newest complete checkpoint after the attempt, when the stage keeps checkpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_iteration: Option<u64>,
    /// The checkpoint the attempt resumed from, as the stage reported it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from: Option<u64>,
    /// Set when a failed attempt is retried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<Retry>,
    /// The stage's metrics.json and verification.json, as the attempt left them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<Json>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verification: Option<Json>,
}

/// Stages by how they ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    pub ran: usize,
    pub cached: usize,
    pub failed: usize,
    /// Skipped after an upstream failure, or cancelled before they ran.
    pub skipped: usize,
    /// Left running on a cluster for the next run to reattach to.
    pub interrupted: usize,
}

/// A gate of a stage, as the run's last event lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageGate {
    pub stage: String,
    #[serde(flatten)]
    pub gate: GateResult,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum RunEvent {
    /// The run's record exists; its stages in plan order.
    RunStarted {
        pipeline: String,
        spec: String,
        record: String,
        stages: Vec<PlannedStage>,
        /// The process that runs it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        process: Option<crate::record::RunProcess>,
    },
    /// The stage's output was found in the cache (`by_another_run`: computed meanwhile by a run
    /// that held its key).
    StageCached {
        stage: String,
        key: String,
        output: String,
        digest: String,
        by_another_run: bool,
    },
    /// The stage's cache key is known. `parts` (what the key is derived from) goes to the
    /// lockfile; it is not part of the JSON lines.
    StageKeyed {
        stage: String,
        key: String,
        #[serde(skip)]
        parts: Option<std::sync::Arc<crate::lock::KeyParts>>,
    },
    /// An upstream stage did not succeed.
    StageSkipped {
        stage: String,
        reason: String,
    },
    /// The run was cancelled before the stage started.
    StageCancelled {
        stage: String,
    },
    /// The stage holds its key and starts its first attempt.
    StageStarted {
        stage: String,
        key: String,
    },
    AttemptStarted {
        stage: String,
        attempt: u32,
        /// The attempt's log, relative to the run's record directory.
        log: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        engine: Option<EngineChoice>,
        /// The checkpoint iteration a failed attempt left, which this one resumes from.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        resumed_from: Option<u64>,
    },
    /// One line the stage printed (the attempt log has every line).
    Output {
        stage: String,
        attempt: u32,
        line: String,
    },
    Progress {
        stage: String,
        attempt: u32,
        label: String,
        done: u64,
        #[serde(default)]
        total: Option<u64>,
        unit: String,
        #[serde(default)]
        message: Option<String>,
        elapsed_s: f64,
        /// Seconds left, once the rate is known (null before).
        #[serde(default)]
        eta_s: Option<f64>,
    },
    AttemptEnded {
        stage: String,
        attempt: u32,
        #[serde(flatten)]
        end: AttemptEnd,
    },
    /// The stage's gates against its metrics.json.
    GatesChecked {
        stage: String,
        gates: Vec<GateResult>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        metrics: Option<Json>,
    },
    StageSucceeded {
        stage: String,
        output: String,
        digest: String,
        duration_s: f64,
    },
    /// The stage failed (or was cancelled: class `cancelled`) and will not run again in this run.
    StageFailed {
        stage: String,
        class: FailureClass,
        message: String,
    },
    /// mflow was interrupted while the stage ran on a cluster; its TrainJob keeps running.
    StageInterrupted {
        stage: String,
        message: String,
    },
    /// Something worth saying that changes nothing (a corrupt cache entry run again, ...).
    Warning {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stage: Option<String>,
        message: String,
    },
    /// The run ended: its record is written.
    RunFinished {
        status: RunStatus,
        exit_code: i32,
        counts: Counts,
        gates: Vec<StageGate>,
        record: String,
    },
}

impl RunEvent {
    /// The stage the event is about, if any.
    pub fn stage(&self) -> Option<&str> {
        match self {
            RunEvent::StageCached { stage, .. }
            | RunEvent::StageKeyed { stage, .. }
            | RunEvent::StageSkipped { stage, .. }
            | RunEvent::StageCancelled { stage }
            | RunEvent::StageStarted { stage, .. }
            | RunEvent::AttemptStarted { stage, .. }
            | RunEvent::Output { stage, .. }
            | RunEvent::Progress { stage, .. }
            | RunEvent::AttemptEnded { stage, .. }
            | RunEvent::GatesChecked { stage, .. }
            | RunEvent::StageSucceeded { stage, .. }
            | RunEvent::StageFailed { stage, .. }
            | RunEvent::StageInterrupted { stage, .. } => Some(stage),
            RunEvent::Warning { stage, .. } => stage.as_deref(),
            RunEvent::RunStarted { .. } | RunEvent::RunFinished { .. } => None,
        }
    }
}

impl EventLine {
    /// Reads one line of the stream; `None` for a line that is not an event of a format this
    /// mflow reads (a diagnostic, or a newer format).
    pub fn parse(line: &str) -> Option<EventLine> {
        let ev: EventLine = serde_json::from_str(line).ok()?;
        (ev.v <= FORMAT).then_some(ev)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_round_trips_with_its_envelope() {
        let line = EventLine {
            v: FORMAT,
            run: "20261204-000000-000-aa".into(),
            time: "2026-12-04T00:00:00Z".into(),
            event: RunEvent::AttemptEnded {
                stage: "train".into(),
                attempt: 1,
                end: AttemptEnd {
                    outcome: AttemptOutcome::Failed(FailureClass::Infra),
                    message: Some("pod deleted".into()),
                    duration_s: 3.5,
                    checkpoint_iteration: Some(20),
                    resumed_from: None,
                    retry: Some(Retry { attempt: 2, after_s: 5.0 }),
                    metrics: None,
                    verification: None,
                },
            },
        };
        let text = serde_json::to_string(&line).unwrap();
        assert!(text.starts_with(r#"{"v":1,"run":"20261204-000000-000-aa","time":"2026-12-04T00:00:00Z","event":"attempt_ended","stage":"train","attempt":1,"outcome":"infra""#), "{text}");
        let back = EventLine::parse(&text).unwrap();
        assert_eq!(back.event, line.event);
        let newer = text.replacen(r#""v":1"#, r#""v":2"#, 1);
        assert!(EventLine::parse(&newer).is_none());
        assert!(EventLine::parse("Error: something").is_none());
    }
}
