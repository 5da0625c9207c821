//! The Kubernetes backend of mflow: every stage attempt runs as a Kubeflow Trainer `TrainJob`
//! (`trainer.kubeflow.org/v1alpha1`, Trainer v2.2 or newer; v2.3 is what mflow is tested against).
//!
//! # How the engine uses it
//!
//! ```no_run
//! # async fn demo(req: mflow_kube::StageRequest) -> miette::Result<()> {
//! use mflow_kube::{KubeBackend, KubeOptions, Outcome};
//! let backend = KubeBackend::connect(KubeOptions::default()).await?;
//! backend.preflight().await?;                       // CRDs, runtimes, PVC, RBAC
//! let (logs, mut rx) = tokio::sync::mpsc::channel(1024);
//! tokio::spawn(async move { while let Some(line) = rx.recv().await { eprintln!("{line}") } });
//! let cancel = tokio_util::sync::CancellationToken::new();
//! match backend.run(&req, logs, cancel).await? {
//!     Outcome::Succeeded => {}
//!     Outcome::Failed { class, message } => eprintln!("{class}: {message}"),
//!     Outcome::Detached { message } => eprintln!("{message}"),
//! }
//! # Ok(()) }
//! ```
//!
//! * [`KubeBackend::run`] submits the TrainJob named by [`trainjob_name`], or reattaches to it
//!   when it already exists and carries this stage's labels and full cache key (so an mflow
//!   restart never resubmits). An own TrainJob that already Completed is reported as success
//!   without running again; an own one that Failed is deleted and submitted afresh. A same-named
//!   object that mflow did not create for this stage is never touched ([`KubeError::ForeignObject`]).
//! * Progress: besides pod log lines (with `rank`), `run` sends state changes as lines with
//!   `rank: None` starting with `mflow:` (submitted, queued, running, finished).
//! * Log lines longer than 64 KiB are cut; the rest of such a line is dropped.
//! * `StageRequest::timeout` (or [`KubeOptions::active_deadline_seconds`]) becomes the TrainJob's
//!   `activeDeadlineSeconds`; expiry ends as `Failed { class: Timeout }`.
//! * Cancelling the token deletes the TrainJob and returns `Failed { class: Cancelled }`;
//!   [`KubeBackend::run_until`]'s detach token leaves it running and returns `Detached`.
//! * A TrainJob none of whose pods starts within [`KubeOptions::start_timeout`] (time queued
//!   by Kueue aside) is deleted and reported as an infra failure; meanwhile its Warning events
//!   (and those of its pods) are reported as they appear.
//! * The stage sees the artifact claim at [`ARTIFACT_MOUNT`] (`/mflow`): the engine must give
//!   `MFLOW_OUTPUT`, `MFLOW_INPUT_*`, `MFLOW_SCRATCH`, `MFLOW_PROGRESS`... as paths below it.
//!   `MFLOW_STAGE` and `MFLOW_ATTEMPT` are added when absent. `PET_*` variables are refused.
//! * Workload code: [`KubeBackend::ensure_workloads`] zips the workload tree (paths relative to
//!   the workloads root, e.g. `mflow_workloads/train.py`) into an immutable ConfigMap named
//!   after its digest; a request with `workload_digest` mounts it at `/opt/mflow/workloads` and
//!   puts `/opt/mflow/workloads/mflow_workloads.zip` first on `PYTHONPATH`, so Python imports
//!   that exact code ahead of the copy baked into the image.
//! * Dry run: [`KubeBackend::dry_run`] and [`KubeBackend::dry_run_workloads`] send the same
//!   objects with `dryRun=All`, so the server (and Trainer's admission webhook) checks them and
//!   stores nothing; [`trainjob_manifest`] and [`workloads_configmap`] build them offline.
//! * Cache index: [`KubeBackend::cache_put`] / [`KubeBackend::cache_get`] /
//!   [`KubeBackend::cache_list`] keep one ConfigMap per (pipeline, key), labelled
//!   `mflow.dev/component=cache` and `mflow.dev/pipeline=<pipeline>`.
//!
//! # Every other object mflow makes
//!
//! Each is built here from a plain options struct; the engine only fills the struct:
//! [`driver::job`] (the batch/v1 Job that runs the engine in the cluster for a run started
//! outside it), [`volume::pod`] (the short-lived pod that mounts the artifact claim),
//! [`schedule::objects`] (the CronJob of `mflow schedule`, its ConfigMap, ServiceAccount and
//! RBAC), and [`rbac::objects`] / [`rbac::yaml`] (what `mflow kube rbac` prints).

mod backend;
mod classify;
mod connect;
pub mod driver;
mod error;
mod expansion;
mod logs;
mod manifest;
mod names;
mod options;
mod quantity;
pub mod rbac;
mod run;
pub mod schedule;
mod state;
mod store;
#[cfg(feature = "testing")]
pub mod testing;
pub mod volume;
mod watch;

use std::collections::BTreeMap;
use std::fmt;

pub use backend::{namespace_exists, KubeBackend};
pub use classify::{classify_failure, job_state, JobState, DISRUPTION_CONDITION, SIGNAL_EXIT_CODES};
pub use error::{describe, KubeError, Target, RBAC_EXAMPLE};
pub use expansion::{escape, expand};
pub use manifest::{
    stage_labels, trainjob_manifest, validate_request, workloads_configmap_name, ANN_KEY, ANN_PIPELINE, ANN_STAGE,
    ARTIFACT_MOUNT, LABEL_COMPONENT, LABEL_KEY, LABEL_MANAGED_BY, LABEL_PIPELINE, LABEL_STAGE, MANAGED_BY,
    PATCH_MANAGER, POD_JOBSET_LABEL, POD_RANK_LABEL, POD_REPLICATED_JOB_LABEL, RESERVED_ENV, WORKLOADS_ROOT,
    WORKLOADS_ZIP,
};
pub use names::{
    check_claim, check_namespace, check_runtime, check_service_account, is_rfc1035_label, label_value, trainjob_name,
    MAX_DNS_LABEL, MAX_DNS_SUBDOMAIN, MAX_TRAINJOB_NAME,
};
pub use options::{KubeOptions, DEFAULT_PVC, DEFAULT_RUNTIME, DEFAULT_START_TIMEOUT};
pub use quantity::memory_problem;
pub use run::Existing;
pub use store::{workloads_configmap, CacheEntry};

/// One attempt of one stage, as the engine hands it to the backend.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StageRequest {
    pub pipeline: String,
    pub stage: String,
    /// Hex cache key of the stage.
    pub key: String,
    /// 1-based attempt number; attempts after the first get their own TrainJob.
    pub attempt: u32,
    /// model | convert | dataset | train | evaluate | export | command
    pub kind: String,
    pub image: String,
    /// Program and arguments, run verbatim (torchrun must be part of it for distributed stages):
    /// a `$` in them, as in `env`'s values, reaches the container as it is ([`escape`]).
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub num_nodes: u32,
    pub nproc_per_node: u32,
    pub gpus_per_node: u32,
    /// CPU request per node, in Kubernetes quantity syntax ("8", "500m").
    pub cpus: Option<String>,
    /// Memory request and limit per node ("64Gi").
    pub memory: Option<String>,
    /// ClusterTrainingRuntime name (e.g. `mflow-torch` or `torch-distributed`).
    pub runtime: String,
    /// Digest naming the workload ConfigMap (see [`KubeBackend::ensure_workloads`]).
    pub workload_digest: Option<String>,
    /// Wall-clock limit of the attempt (TrainJob `activeDeadlineSeconds`, whole seconds rounded
    /// up); overrides [`KubeOptions::active_deadline_seconds`]. Expiry is reported as a timeout.
    pub timeout: Option<std::time::Duration>,
}

/// How a stage attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    Failed {
        class: FailureClass,
        message: String,
    },
    /// Stopped following at the caller's request; the TrainJob runs on.
    Detached {
        message: String,
    },
}

/// Why a stage attempt failed (mflow's own classes; a Kubernetes failure is never `Gate`).
pub use mflow_progress::FailureClass;

/// One line of stage output. `rank` is the node rank of the pod it came from; `None` marks
/// mflow's own state lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    pub rank: Option<u32>,
    pub line: String,
    /// The container instance the line came from (`<pod uid>/<restart count>`): its lines
    /// arrive in order, from the first, each time it is followed.
    pub stream: Option<String>,
}

impl fmt::Display for LogLine {
    /// `[rank N] text`, or the text alone for mflow's own lines.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.rank {
            Some(rank) => write!(f, "[rank {rank}] {}", self.line),
            None => f.write_str(&self.line),
        }
    }
}
