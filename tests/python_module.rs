//! The `mflow` Python module reads mflow's run events and run records into dataclasses of its
//! own (python/mflow/events.py, record.py). These fixtures hold one of every event, and the
//! record they fold into, as mflow writes them: the module's tests read each and refuse a key
//! or an event its dataclasses do not name, so the two sides cannot drift apart.
//! `UPDATE_GENERATED=1 cargo nextest run --test python_module` writes them.

use std::path::{Path, PathBuf};

use mflow_contract::event::{AttemptEnd, Counts, EventLine, PlannedStage, Retry, RunEvent, StageGate, FORMAT};
use mflow_contract::record::{AttemptOutcome, EngineChoice, GateResult, RunProcess, RunRecord, RunStatus};
use mflow_contract::FailureClass;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("python/tests/fixtures").join(name)
}

fn check(path: &Path, want: &str) {
    if std::env::var_os("UPDATE_GENERATED").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, want).unwrap();
        return;
    }
    let have = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        have == want,
        "{} is not what mflow writes: run `UPDATE_GENERATED=1 cargo nextest run --test python_module`",
        path.display()
    );
}

/// The name of every variant: a new event fails to compile here until it is in [`every_event`].
fn name(e: &RunEvent) -> &'static str {
    match e {
        RunEvent::RunStarted { .. } => "run_started",
        RunEvent::StageCached { .. } => "stage_cached",
        RunEvent::StageKeyed { .. } => "stage_keyed",
        RunEvent::StageSkipped { .. } => "stage_skipped",
        RunEvent::StageCancelled { .. } => "stage_cancelled",
        RunEvent::StageStarted { .. } => "stage_started",
        RunEvent::AttemptStarted { .. } => "attempt_started",
        RunEvent::Output { .. } => "output",
        RunEvent::Progress { .. } => "progress",
        RunEvent::AttemptEnded { .. } => "attempt_ended",
        RunEvent::GatesChecked { .. } => "gates_checked",
        RunEvent::StageSucceeded { .. } => "stage_succeeded",
        RunEvent::StageFailed { .. } => "stage_failed",
        RunEvent::StageInterrupted { .. } => "stage_interrupted",
        RunEvent::Warning { .. } => "warning",
        RunEvent::RunFinished { .. } => "run_finished",
    }
}

fn engine() -> Option<EngineChoice> {
    Some(EngineChoice { name: "reference".into(), reason: "no GPU visible".into() })
}

fn gate(passed: bool) -> GateResult {
    GateResult { metric: "val_ppl".into(), condition: "< 20".into(), value: Some(12.5), passed }
}

/// One of every event, with every optional field set, as a run of five stages would say them.
fn every_event() -> Vec<RunEvent> {
    let s = |n: &str| n.to_string();
    let metrics = serde_json::json!({"val_ppl": 12.5, "samples": [{"prompt": "fn main() {", "text": "}"}]});
    vec![
        RunEvent::RunStarted {
            pipeline: s("gpt-tp2"),
            spec: s("/p/specs/gpt-tp2.toml"),
            record: s("/p/specs/.mflow/runs/20261204-000000-000-aa"),
            stages: ["model", "train", "evaluate", "export", "report"]
                .iter()
                .map(|n| PlannedStage { name: s(n), kind: s(n), engine: if *n == "train" { engine() } else { None } })
                .collect(),
            process: Some(RunProcess { host: s("host"), pid: 42, start: 1000 }),
        },
        RunEvent::StageCached {
            stage: s("model"),
            key: s("k1"),
            output: s("/c/k1"),
            digest: s("d1"),
            by_another_run: true,
        },
        RunEvent::StageKeyed { stage: s("train"), key: s("k2"), parts: None },
        RunEvent::StageStarted { stage: s("train"), key: s("k2") },
        RunEvent::AttemptStarted {
            stage: s("train"),
            attempt: 1,
            log: s("stages/train/attempt-1.log"),
            engine: engine(),
            resumed_from: None,
        },
        RunEvent::Output { stage: s("train"), attempt: 1, line: s("iteration 1/2 loss 9.0") },
        RunEvent::Progress {
            stage: s("train"),
            attempt: 1,
            label: s("iteration"),
            done: 1,
            total: Some(2),
            unit: s("it"),
            message: Some(s("loss 9.0")),
            elapsed_s: 1.5,
            eta_s: Some(1.5),
        },
        RunEvent::AttemptEnded {
            stage: s("train"),
            attempt: 1,
            end: AttemptEnd {
                outcome: AttemptOutcome::Failed(FailureClass::Infra),
                message: Some(s("pod deleted")),
                duration_s: 3.5,
                checkpoint_iteration: Some(1),
                resumed_from: Some(0),
                retry: Some(Retry { attempt: 2, after_s: 2.0 }),
                metrics: Some(metrics.clone()),
                verification: Some(serde_json::json!({"max_abs_diff": 0.0})),
            },
        },
        RunEvent::AttemptStarted {
            stage: s("train"),
            attempt: 2,
            log: s("stages/train/attempt-2.log"),
            engine: engine(),
            resumed_from: Some(1),
        },
        RunEvent::AttemptEnded {
            stage: s("train"),
            attempt: 2,
            end: AttemptEnd {
                outcome: AttemptOutcome::Success,
                message: None,
                duration_s: 2.0,
                checkpoint_iteration: Some(2),
                resumed_from: Some(1),
                retry: None,
                metrics: None,
                verification: None,
            },
        },
        RunEvent::GatesChecked { stage: s("train"), gates: vec![gate(true)], metrics: Some(metrics) },
        RunEvent::StageSucceeded { stage: s("train"), output: s("/c/k2"), digest: s("d2"), duration_s: 5.5 },
        RunEvent::StageFailed {
            stage: s("evaluate"),
            class: FailureClass::Gate,
            message: s("gate val_ppl < 20 failed"),
        },
        RunEvent::StageSkipped { stage: s("export"), reason: s("evaluate failed") },
        RunEvent::StageCancelled { stage: s("report") },
        RunEvent::StageInterrupted { stage: s("report"), message: s("left running on the cluster") },
        RunEvent::Warning { stage: Some(s("train")), message: s("a corrupt cache entry runs again") },
        RunEvent::RunFinished {
            status: RunStatus::Failed,
            exit_code: 4,
            counts: Counts { ran: 1, cached: 1, failed: 1, skipped: 2, interrupted: 1 },
            gates: vec![StageGate { stage: s("evaluate"), gate: gate(false) }],
            record: s("/p/specs/.mflow/runs/20261204-000000-000-aa"),
        },
    ]
}

#[test]
fn the_python_module_reads_every_event_and_the_record_they_make() {
    let run = "20261204-000000-000-aa";
    let events = every_event();
    let mut names: Vec<&str> = events.iter().map(name).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), 16, "every event at least once");
    let mut lines = String::new();
    let mut record = RunRecord {
        format: mflow_contract::record::FORMAT,
        id: run.into(),
        pipeline: String::new(),
        spec: String::new(),
        started: String::new(),
        finished: None,
        status: RunStatus::Running,
        exit_code: None,
        mflow_version: "0.1.0".into(),
        process: None,
        stages: Default::default(),
        order: vec![],
    };
    for (i, event) in events.into_iter().enumerate() {
        let time = format!("2026-12-04T00:00:{i:02}Z");
        record.apply(&|| time.clone(), &event);
        let line = EventLine { v: FORMAT, run: run.into(), time: time.clone(), event };
        lines.push_str(&serde_json::to_string(&line).unwrap());
        lines.push('\n');
    }
    check(&fixture("events.jsonl"), &lines);
    check(&fixture("run.json"), &(serde_json::to_string_pretty(&record).unwrap() + "\n"));
}
