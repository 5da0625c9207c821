//! How mflow reaches the cluster and shapes the TrainJobs it submits.

use std::path::PathBuf;
use std::time::Duration;

/// Default name of the ReadWriteMany claim holding mflow's artifacts.
pub const DEFAULT_PVC: &str = "mflow-artifacts";
/// The ClusterTrainingRuntime shipped in examples/kubernetes/runtime.yaml.
pub const DEFAULT_RUNTIME: &str = "mflow-torch";
/// Long enough for a large GPU image to be pulled onto a fresh node.
pub const DEFAULT_START_TIMEOUT: Duration = Duration::from_secs(15 * 60);

/// Connection and submission settings of the Kubernetes backend.
#[derive(Debug, Clone)]
pub struct KubeOptions {
    /// Kubeconfig file; `None` uses `KUBECONFIG`, `~/.kube/config`, or the in-cluster service account.
    pub kubeconfig: Option<PathBuf>,
    /// Kubeconfig context; `None` uses the current context.
    pub context: Option<String>,
    /// Namespace of TrainJobs and ConfigMaps; `None` uses the context's namespace (or `default`).
    pub namespace: Option<String>,
    /// ReadWriteMany PersistentVolumeClaim mounted at [`crate::ARTIFACT_MOUNT`] in every stage.
    pub pvc: String,
    /// Service account of stage pods; `None` keeps the runtime's.
    pub service_account: Option<String>,
    /// Size limit of the memory-backed `/dev/shm`; `None` leaves it unbounded (node memory).
    pub shm_size: Option<String>,
    /// `activeDeadlineSeconds` of every TrainJob; expiry is reported as a timeout.
    pub active_deadline_seconds: Option<i64>,
    /// ClusterTrainingRuntimes that [`crate::KubeBackend::preflight`] checks for.
    pub runtimes: Vec<String>,
    /// How long `run` keeps reading logs after the TrainJob finished.
    pub log_drain: Duration,
    /// How long a TrainJob may go without any of its pods starting (not counting time queued
    /// by Kueue) before the attempt is given up as an infra failure and the TrainJob deleted.
    pub start_timeout: Duration,
    /// How often a TrainJob that has not started is checked for Warning events.
    pub event_poll: Duration,
}

impl Default for KubeOptions {
    fn default() -> Self {
        KubeOptions {
            kubeconfig: None,
            context: None,
            namespace: None,
            pvc: DEFAULT_PVC.to_string(),
            service_account: None,
            shm_size: None,
            active_deadline_seconds: None,
            runtimes: vec![DEFAULT_RUNTIME.to_string()],
            log_drain: Duration::from_secs(10),
            start_timeout: DEFAULT_START_TIMEOUT,
            event_poll: Duration::from_secs(10),
        }
    }
}

impl KubeOptions {
    /// The namespace used when none was configured or inferred.
    pub fn namespace_or_default(&self) -> &str {
        self.namespace.as_deref().unwrap_or("default")
    }
}
