//! mflow stopped while its stage runs on the cluster: SIGKILL and SIGTERM leave the TrainJob to
//! the next run, which reattaches; SIGINT cancels it.

use mflow_e2e::{secs, wait_until, Case, Out, RunStatus, StageStatus};

const SLOW: &str = r#"[stages.slow]
kind = "command"
env = { MFLOW_E2E_DURATION = "25s" }
run = ["sh", "-c", "true"]
"#;

/// Runs the slow stage of the case and sends mflow `signal` once its pod runs.
fn signal_mid_stage(c: &Case, signal: i32) -> Out {
    let spec = c.spec(SLOW).write();
    let run = c.mflow(["run", &spec]).spawn();
    wait_until(secs(60), "the stage's pod to run", || c.running_pod(None).is_some());
    run.signal(signal);
    run.wait()
}

pub fn sigkill_then_reattach(c: &Case) {
    signal_mid_stage(c, libc::SIGKILL);
    reattach(c);
}

pub fn sigterm_detaches_and_reattaches(c: &Case) {
    assert_eq!(signal_mid_stage(c, libc::SIGTERM).code, 143, "exit code after SIGTERM");
    let rec = c.record();
    assert_eq!(rec.status, RunStatus::Interrupted);
    assert_eq!(rec.stages["slow"].status, StageStatus::Interrupted);
    // The TrainJob is neither deleted nor being deleted.
    let jobs = c.trainjobs();
    assert_eq!(jobs.len(), 1, "TrainJobs");
    assert!(!jobs[0].deleting(), "the TrainJob is being deleted");
    reattach(c);
}

pub fn sigint_cancels(c: &Case) {
    assert_eq!(signal_mid_stage(c, libc::SIGINT).code, 130, "exit code after SIGINT");
    assert_eq!(c.record().status, RunStatus::Cancelled);
    wait_until(secs(60), "the TrainJob to be deleted", || c.trainjobs().is_empty());
}

/// The next run reattaches to the one TrainJob and submits nothing.
fn reattach(c: &Case) {
    c.mflow(["run"]).arg(c.dir().join("spec.toml")).run();
    let log = c.attempt_log("slow", 1);
    assert!(log.contains("reattaching to TrainJob"), "attempt log:\n{log}");
    assert_eq!(c.trainjobs().len(), 1, "TrainJobs (none resubmitted)");
}
