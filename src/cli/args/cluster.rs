//! The arguments of the commands that talk to a cluster: `mflow kube`, `mflow schedule`, and
//! where a run outside the cluster lives.

use clap::{Args, Subcommand};

use super::{BackendChoice, SpecArgs};

#[derive(Subcommand, Debug)]
pub enum KubeCommand {
    /// The least-privilege RBAC of mflow in one namespace, as YAML for `kubectl apply -f -`:
    /// exactly the rights the preflight checks.
    Rbac {
        /// The namespace mflow runs TrainJobs in.
        #[arg(long, default_value = "default")]
        namespace: String,
        /// ServiceAccount to create and bind (repeatable; default `mflow` when no subject is given).
        #[arg(long = "service-account", value_name = "NAME")]
        service_accounts: Vec<String>,
        /// User to bind, e.g. the person running mflow from a laptop (repeatable).
        #[arg(long = "user", value_name = "NAME")]
        users: Vec<String>,
        /// Group to bind (repeatable).
        #[arg(long = "group", value_name = "NAME")]
        groups: Vec<String>,
        /// Name of the Role and RoleBinding (the cluster-wide ones get `-<namespace>` appended).
        #[arg(long, default_value = "mflow")]
        name: String,
    },
}

/// Records of runs started outside the cluster, read through it.
#[derive(Args, Debug, Clone)]
pub struct RemoteArgs {
    /// `kubernetes`: the runs started from outside the cluster (by `mflow run --backend
    /// kubernetes` where the volume is not mounted), read on its volume. Implied by
    /// --namespace, --context, or a --workdir on the volume that is not mounted here.
    #[arg(long, value_enum)]
    pub backend: Option<BackendChoice>,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// Which cluster a run outside it lives in.
#[derive(Args, Debug, Clone)]
pub struct ClusterArgs {
    /// Namespace of the run (default: the kubeconfig context's).
    #[arg(long, short)]
    pub namespace: Option<String>,
    /// Kubeconfig context (default: the current one).
    #[arg(long)]
    pub context: Option<String>,
}

#[derive(Subcommand, Debug)]
pub enum ScheduleCommand {
    /// Print the Kubernetes objects of the spec's [schedule] as YAML.
    Render {
        #[command(flatten)]
        spec: SpecArgs,
        /// Namespace of the objects (default: [pipeline.kubernetes] namespace, else "default").
        #[arg(long)]
        namespace: Option<String>,
    },
    /// Apply them to the cluster with server-side apply.
    Apply {
        #[command(flatten)]
        spec: SpecArgs,
    },
}
