//! The harness of mflow's end-to-end cases on a real control plane (Kubeflow Trainer, JobSet,
//! kwok or a kubelet with containerd, all on 127.0.0.1; `tests/e2e/kubernetes/cluster.sh` brings
//! it up).
//!
//! A case runs the real `mflow` binary (`MFLOW_BIN`) in a process of its own, as a user does, and
//! checks what the user sees (exit code and words), the run records (read with mflow's own record
//! types) and the cluster's objects (read with the Kubernetes client):
//!
//! ```no_run
//! # fn demo(c: &mflow_e2e::Case) {
//! let spec = c.spec("[stages.one]\nkind = \"command\"\nrun = [\"true\"]\n").write();
//! c.mflow(["run", spec.as_str()]).code(0).run().contains("succeeded: 1 ran");
//! assert_eq!(c.trainjobs().len(), 1);
//! # }
//! ```
//!
//! The cases themselves are the integration test `cases` of this package, one test per case,
//! in the modules `kwok` and `kubelet` after the node they need.

mod case;
mod cluster;
mod command;
mod suite;
mod trainjob;

use std::time::{Duration, Instant};

pub use case::{Case, Outside, SpecBuilder};
pub use cluster::{pod_env, pod_env_field, Cluster, Webhooks};
pub use command::{Mflow, Out, Running};
pub use suite::{Mode, Suite, STAGE_IMAGE};
pub use trainjob::TrainJob;

/// The types of mflow's run records (`run.json`, `mflow.lock`).
pub use mflow_contract::lock::Lockfile;
pub use mflow_contract::record::{Attempt, AttemptOutcome, RunRecord, RunStatus, StageRecord, StageStatus};

/// Runs one case: checks that the suite's cluster is up in `mode`, prints what the case is, and
/// calls `body`, which fails by panicking.
pub fn run_case(mode: Mode, name: &'static str, body: fn(&Case)) {
    let suite = Suite::load(mode);
    println!("== {name} ({mode}, mflow {})", suite.bin.display());
    let started = Instant::now();
    let case = Case::new(suite, name);
    body(&case);
    println!("== {name} passed in {:.1}s", started.elapsed().as_secs_f64());
}

/// Polls `done` every half second until it holds; panics after `limit` naming `what`.
pub fn wait_until(limit: Duration, what: &str, done: impl FnMut() -> bool) {
    assert!(wait_for(limit, done), "timed out after {}s waiting for: {what}", limit.as_secs());
}

/// Polls `done` every half second until it holds or `limit` passed; whether it held.
pub fn wait_for(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if done() {
            return true;
        }
        if start.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Seconds, for the waits of the cases.
pub const fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// The text as one line: every newline and box edge (`│`) of mflow's error reports a space,
/// and runs of spaces one, so that a sentence wrapped across lines is found whole.
pub fn flat(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for ch in text.chars() {
        let ch = if ch == '\n' || ch == '│' { ' ' } else { ch };
        if !(ch == ' ' && out.ends_with(' ')) {
            out.push(ch);
        }
    }
    out
}

/// Every match of `prefix` followed by digits in `text`, in order (as `grep -o 'PREFIX[0-9]*'`).
pub fn numbered(text: &str, prefix: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in text.lines() {
        let mut rest = line;
        while let Some(at) = rest.find(prefix) {
            let after = &rest[at + prefix.len()..];
            let digits = after.bytes().take_while(u8::is_ascii_digit).count();
            found.push(format!("{prefix}{}", &after[..digits]));
            rest = &after[digits..];
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_joins_wrapped_reports() {
        assert_eq!(
            flat("  × the namespace\n  │ \"x\" does not\n  │   exist\n"),
            " × the namespace \"x\" does not exist "
        );
    }

    #[test]
    fn numbered_finds_every_match() {
        let text = "count | [rank 0] line 1\nnoise\n[rank 0] line 2 [rank 0] line 33\n";
        assert_eq!(numbered(text, "[rank 0] line "), ["[rank 0] line 1", "[rank 0] line 2", "[rank 0] line 33"]);
    }
}
