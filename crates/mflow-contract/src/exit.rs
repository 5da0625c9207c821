//! Exit codes. This table is part of mflow's interface: scripts and CI depend on it.
//! `mflow exit-codes` prints it and docs/exit-codes.md holds it, both generated from [`TABLE`].

use crate::record::{RunRecord, RunStatus, StageStatus};
use crate::FailureClass;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitCode {
    /// Everything succeeded (or was cached).
    Success,
    /// A stage failed in its own code (user or oom).
    StageFailed,
    /// The spec or the command line is invalid; nothing ran.
    Invalid,
    /// Infrastructure failures or timeouts outlasted their retries.
    Infra,
    /// A metric gate failed.
    GateFailed,
    /// `mflow reproduce` refused: an input no longer matches the lockfile.
    Mismatch,
    /// The run was cancelled (Ctrl-C).
    Cancelled,
    /// mflow was interrupted (SIGTERM, SIGHUP, ...); TrainJobs were left running for the next run.
    Interrupted,
    /// A bug or an unexpected environment problem in mflow itself.
    Internal,
}

/// One row of the table.
pub struct ExitInfo {
    pub exit: ExitCode,
    pub code: i32,
    pub meaning: &'static str,
    pub cause: &'static str,
    pub remedy: &'static str,
}

/// The exit codes, in the order of their numbers.
pub const TABLE: &[ExitInfo] = &[
    ExitInfo { exit: ExitCode::Success, code: 0, meaning: "success: every stage succeeded or was cached", cause: "", remedy: "" },
    ExitInfo {
        exit: ExitCode::StageFailed,
        code: 1,
        meaning: "a stage failed in its own code (user error or out of memory)",
        cause: "a command exited non-zero, a workload raised, CUDA ran out of memory, an input a stage reads is wrong",
        remedy: "`mflow logs STAGE` shows the stage's log; fix the code, the inputs or the parameters",
    },
    ExitInfo {
        exit: ExitCode::Invalid,
        code: 2,
        meaning: "invalid spec or command line; nothing ran",
        cause: "unknown key, wrong type, cycle, unknown stage in `--force`, malformed `--fail-if`, bad `[schedule]` cron, unknown run id, an invalid `MFLOW_*` setting; on Kubernetes, a cluster setting only the user can fix (below)",
        remedy: "the diagnostic names the file, key and line, or the kubeconfig, context and user",
    },
    ExitInfo {
        exit: ExitCode::Infra,
        code: 3,
        meaning: "infrastructure failures or timeouts exhausted their retries",
        cause: "lost node, NCCL timeout, a Hub that answers 5xx or refuses the connection, stage `timeout` reached on every attempt; an API server that does not answer",
        remedy: "rerun later; raise `retries.max` or `timeout`",
    },
    ExitInfo {
        exit: ExitCode::GateFailed,
        code: 4,
        meaning: "an evaluation gate failed",
        cause: "a stage's `gates` condition on metrics.json did not hold; `mflow metrics diff --fail-if` found a regression",
        remedy: "compare the metrics (`mflow metrics diff`, `mflow report`)",
    },
    ExitInfo {
        exit: ExitCode::Mismatch,
        code: 5,
        meaning: "reproduce refused: an input digest no longer matches the lockfile",
        cause: "`mflow reproduce RUN` found a changed input file, a changed spec copy, or a changed environment / workload digest",
        remedy: "the message names the file or stage; restore it, or run the pipeline anew",
    },
    ExitInfo {
        exit: ExitCode::Internal,
        code: 70,
        meaning: "internal error in mflow",
        cause: "the workdir cannot be written, a bug",
        remedy: "the message names the path; report bugs with `RUST_LOG=debug` output",
    },
    ExitInfo {
        exit: ExitCode::Cancelled,
        code: 130,
        meaning: "cancelled (Ctrl-C): running stages stopped, their TrainJobs deleted",
        cause: "Ctrl-C (SIGINT) at the terminal",
        remedy: "rerun: finished stages are cached, training resumes from its checkpoint",
    },
    ExitInfo {
        exit: ExitCode::Interrupted,
        code: 143,
        meaning: "interrupted (SIGTERM, SIGHUP or another signal that ends mflow): local stages stopped, TrainJobs left running; run again to reattach",
        cause: "a pod's eviction, drain or deadline, `kill`, a closed terminal or ssh session, Ctrl-\\ (SIGQUIT)",
        remedy: "rerun: it reattaches to the TrainJobs still running (nothing is submitted twice); finished stages are cached",
    },
];

impl ExitCode {
    fn info(self) -> &'static ExitInfo {
        TABLE.iter().find(|i| i.exit == self).expect("every exit code is in the table")
    }

    pub fn code(self) -> i32 {
        self.info().code
    }

    pub fn meaning(self) -> &'static str {
        self.info().meaning
    }

    /// The code a process exited with, read back (from a driver pod in the cluster).
    pub fn from_code(code: i32) -> Option<ExitCode> {
        TABLE.iter().find(|i| i.code == code).map(|i| i.exit)
    }

    /// The exit code of a finished run: the most telling failure wins (a stage's own failure
    /// over infrastructure over a gate).
    pub fn for_run(rec: &RunRecord) -> ExitCode {
        let classes: Vec<FailureClass> =
            rec.stages.values().filter(|s| s.status == StageStatus::Failed).filter_map(|s| s.class).collect();
        ExitCode::for_ending(rec.status, &classes)
    }

    /// The exit code of a run that ended with `status`, given the classes of its failed stages.
    pub fn for_ending(status: RunStatus, failed: &[FailureClass]) -> ExitCode {
        match status {
            RunStatus::Cancelled => return ExitCode::Cancelled,
            RunStatus::Interrupted => return ExitCode::Interrupted,
            RunStatus::Succeeded => return ExitCode::Success,
            RunStatus::Running | RunStatus::Failed => {}
        }
        let any = |c: &[FailureClass]| failed.iter().any(|x| c.contains(x));
        if any(&[FailureClass::User, FailureClass::Oom]) {
            ExitCode::StageFailed
        } else if any(&[FailureClass::Infra, FailureClass::Timeout]) {
            ExitCode::Infra
        } else if any(&[FailureClass::Gate]) {
            ExitCode::GateFailed
        } else if failed.is_empty() {
            ExitCode::Cancelled
        } else {
            ExitCode::StageFailed
        }
    }
}

/// The table as `mflow exit-codes` prints it.
pub fn text() -> String {
    TABLE.iter().map(|i| format!("{:>4}  {}\n", i.code, i.meaning)).collect()
}

/// The table as docs/exit-codes.md holds it.
pub fn markdown() -> String {
    let mut out = String::from("| code | meaning | typical cause | what to do |\n|---|---|---|---|\n");
    for i in TABLE {
        out.push_str(&format!("| {} | {} | {} | {} |\n", i.code, i.meaning, i.cause, i.remedy));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_and_read_back() {
        for i in TABLE {
            assert_eq!(ExitCode::from_code(i.code), Some(i.exit));
            assert_eq!(i.exit.code(), i.code);
        }
        assert_eq!(ExitCode::from_code(6), None);
    }
}
