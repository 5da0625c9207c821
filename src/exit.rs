//! Exit codes. This table is part of mflow's interface: scripts and CI depend on it, and
//! docs/exit-codes.md documents it.

use crate::record::{RunRecord, RunStatus, StageStatus};

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
    /// mflow was interrupted (SIGTERM, SIGHUP); TrainJobs were left running for the next run.
    Interrupted,
    /// A bug or an unexpected environment problem in mflow itself.
    Internal,
}

impl ExitCode {
    pub fn code(self) -> i32 {
        match self {
            ExitCode::Success => 0,
            ExitCode::StageFailed => 1,
            ExitCode::Invalid => 2,
            ExitCode::Infra => 3,
            ExitCode::GateFailed => 4,
            ExitCode::Mismatch => 5,
            ExitCode::Cancelled => 130,
            ExitCode::Interrupted => 143,
            ExitCode::Internal => 70,
        }
    }

    /// The code a process exited with, read back (from a driver pod in the cluster).
    pub fn from_code(code: i32) -> Option<ExitCode> {
        use ExitCode::*;
        [Success, StageFailed, Invalid, Infra, GateFailed, Mismatch, Cancelled, Interrupted, Internal].into_iter().find(|c| c.code() == code)
    }

    pub const TABLE: &'static [(i32, &'static str)] = &[
        (0, "success: every stage succeeded or was cached"),
        (1, "a stage failed in its own code (user error or out of memory)"),
        (2, "invalid spec or command line; nothing ran"),
        (3, "infrastructure failures or timeouts exhausted their retries"),
        (4, "an evaluation gate failed"),
        (5, "reproduce refused: an input digest no longer matches the lockfile"),
        (70, "internal error in mflow"),
        (130, "cancelled (Ctrl-C): running stages stopped, their TrainJobs deleted"),
        (143, "interrupted (SIGTERM or SIGHUP): local stages stopped, TrainJobs left running; run again to reattach"),
    ];
}

/// The exit code of a command stopped by the cluster before anything ran, the same for every
/// command (run, runs, status, logs, report, output, attach, cancel, run --dry-run): what the
/// user must fix (the kubeconfig, its context, rejected credentials, an untrusted server
/// certificate, a missing namespace, a name Kubernetes refuses, a bad request) is 2; a cluster
/// that did not answer or lacks a piece (Trainer, a runtime, the claim, a right) is 3.
pub fn for_cluster(e: &crate::backend::kubernetes::KubernetesError) -> ExitCode {
    if e.class() == crate::exec::retry::FailureClass::User {
        ExitCode::Invalid
    } else {
        ExitCode::Infra
    }
}

/// [`for_cluster`] of a backend error (`class()` is `User` exactly for these).
pub fn for_kube(e: &mflow_kube::KubeError) -> ExitCode {
    if e.is_users_to_fix() {
        ExitCode::Invalid
    } else {
        ExitCode::Infra
    }
}

/// The exit code of a finished run: the most telling failure wins.
pub fn for_run(rec: &RunRecord) -> ExitCode {
    if rec.status == RunStatus::Cancelled {
        return ExitCode::Cancelled;
    }
    if rec.status == RunStatus::Interrupted {
        return ExitCode::Interrupted;
    }
    if rec.status == RunStatus::Succeeded {
        return ExitCode::Success;
    }
    let classes: Vec<&str> = rec
        .stages
        .values()
        .filter(|s| s.status == StageStatus::Failed)
        .filter_map(|s| s.message.as_deref())
        .map(|m| m.split(':').next().unwrap_or(""))
        .collect();
    if classes.iter().any(|c| *c == "user" || *c == "oom") {
        ExitCode::StageFailed
    } else if classes.iter().any(|c| *c == "infra" || *c == "timeout") {
        ExitCode::Infra
    } else if classes.contains(&"gate") {
        ExitCode::GateFailed
    } else if classes.is_empty() {
        ExitCode::Cancelled
    } else {
        ExitCode::StageFailed
    }
}
