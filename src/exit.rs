//! Exit codes: the table is part of mflow's contract (`mflow_contract::exit`); what is decided
//! here is which code a cluster's refusal gets.

pub use mflow_contract::exit::{markdown, text, ExitCode, TABLE};

/// Ends the process with `code`, from any thread, after flushing the standard streams and
/// without the allocator's teardown: the kernel frees the heap at once, while mimalloc's exit
/// handler walked and returned every page first (7% of a large no-op run).
pub fn now(code: ExitCode) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: nothing is left to run; both standard streams are flushed above.
    unsafe { libc::_exit(code.code()) }
}

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
