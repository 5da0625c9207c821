//! Exit codes: the table is part of mflow's contract (`mflow_contract::exit`); what is decided
//! here is which code a cluster's refusal gets.

pub use mflow_contract::exit::{markdown, text, ExitCode, TABLE};

/// The exit code of a command stopped by the cluster before anything ran, the same for every
/// command (run, runs, status, logs, report, output, attach, cancel, run --dry-run): what the
/// user must fix (the kubeconfig, its context, rejected credentials, an untrusted server
/// certificate, a missing namespace, a name Kubernetes refuses, a bad request) is 2; a cluster
/// that did not answer or lacks a piece (Trainer, a runtime, the claim, a right) is 3.
pub fn for_cluster(e: &crate::backend::kubernetes::KubernetesError) -> ExitCode {
    if e.class() == mflow_contract::FailureClass::User {
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
pub fn for_run(rec: &crate::record::RunRecord) -> ExitCode {
    ExitCode::for_run(rec)
}
