//! Where a stage's attempt runs. A backend takes a [`Job`] and returns an [`Outcome`]; it knows
//! nothing of caching, retries or plans.

pub mod kubernetes;
mod lines;
pub mod local;
pub mod pool;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use mflow_contract::FailureClass;

use crate::spec::BackendKind;
use crate::workdir::Workdir;

pub use crate::workdir::AttemptArea;
pub use lines::{Lines, Printed};

/// One attempt of one stage, fully resolved.
#[derive(Debug, Clone)]
pub struct Job {
    pub stage: String,
    pub key: String,
    pub attempt: u32,
    /// Commands run in order; the attempt fails at the first that fails.
    pub steps: Vec<Vec<String>>,
    pub env: BTreeMap<String, String>,
    pub cwd: PathBuf,
    pub timeout: Option<Duration>,
    /// The attempt's log file (stdout and stderr, interleaved by line).
    pub log: PathBuf,
    /// Where the stage may write `{"class": ..., "message": ...}`.
    pub status_file: PathBuf,
    /// Where its output goes ([`Backend::attempt_area`]).
    pub area: AttemptArea,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Success,
    Failed {
        class: FailureClass,
        message: String,
    },
    /// mflow was interrupted and left the attempt running where it can be reattached to (a
    /// TrainJob); the next run picks it up.
    Detached {
        message: String,
    },
}

/// How hard to stop running attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Cancel {
    None,
    /// mflow itself is asked to go (SIGTERM, SIGHUP: a pod's eviction or deadline, a closed
    /// terminal): work that outlives mflow (TrainJobs) is left running for the next `mflow run`
    /// to reattach to; local processes, which cannot be reattached to, stop as for `Graceful`.
    Detach,
    /// SIGTERM, a grace period, then SIGKILL; TrainJobs are deleted.
    Graceful,
    /// SIGKILL now.
    Immediate,
}

/// A line a stage printed.
#[derive(Debug, Clone)]
pub struct Line {
    pub stage: String,
    pub attempt: u32,
    pub text: String,
}

/// Where this run's attempts go: local processes, or TrainJobs on a cluster.
#[derive(Clone)]
pub enum Backend {
    Local,
    Kubernetes(Arc<kubernetes::Kubernetes>),
}

impl Backend {
    /// The plan's backend, connected and checked before anything starts.
    pub async fn for_plan(plan: &crate::plan::Plan) -> Result<Backend, kubernetes::KubernetesError> {
        match plan.spec.pipeline.backend {
            BackendKind::Kubernetes => Ok(Backend::Kubernetes(Arc::new(kubernetes::Kubernetes::connect(plan).await?))),
            BackendKind::Local => Ok(Backend::Local),
        }
    }

    /// Where the output of attempt `attempt` of `stage` (key `key`, run `run_id`) goes, asked
    /// before its job is built so that the job names it: locally the attempt's staging
    /// directory; on Kubernetes the directory of the attempt's TrainJob, found again by the
    /// next mflow process when this one stops before the TrainJob ends.
    pub fn attempt_area(&self, workdir: &Workdir, stage: &str, key: &str, attempt: u32, run_id: &str) -> AttemptArea {
        match self {
            Backend::Local => workdir.staged_attempt(key, run_id),
            Backend::Kubernetes(k) => k.attempt_area(workdir, stage, key, attempt),
        }
    }

    pub async fn run(&self, job: &Job, lines: Lines, cancel: watch::Receiver<Cancel>) -> Outcome {
        match self {
            Backend::Local => local::run(job, lines, cancel).await,
            Backend::Kubernetes(k) => k.run(job, lines, cancel).await,
        }
    }

    /// Called after an output is committed; returns a warning worth showing, if any.
    pub async fn committed(&self, key: &str, stage: &str, output: &Path, digest: &str) -> Option<String> {
        match self {
            Backend::Local => None,
            Backend::Kubernetes(k) => k.committed(key, stage, output, digest).await,
        }
    }

    /// The resources the scheduler hands out: this machine's, or (on a cluster, whose own
    /// scheduler places pods) as many as stages ask for.
    pub fn pool(&self, env: &crate::env::Environment) -> pool::Pool {
        match self {
            Backend::Local => pool::Pool::new(env.cpus, env.gpus.clone()),
            Backend::Kubernetes(_) => pool::Pool::new(1 << 16, (0..4096).map(|i| format!("cluster-{i}")).collect()),
        }
    }
}

/// GPUs the processes of a stage will see: on a cluster, what the stage requests on each of
/// its nodes times its nodes (the machine running mflow may have none); locally, what it
/// requests (the pool hands it exactly that many), else this machine's.
pub fn stage_gpus(spec: &crate::spec::Spec, stage: &crate::spec::StageSpec, env: &crate::env::Environment) -> usize {
    match spec.pipeline.backend {
        BackendKind::Kubernetes => stage.resources.gpus as usize * stage.nodes.max(1) as usize,
        _ if stage.resources.gpus > 0 => (stage.resources.gpus as usize).min(env.gpus.len()),
        _ => env.gpus.len(),
    }
}
