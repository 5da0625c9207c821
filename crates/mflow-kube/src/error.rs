//! Errors of the Kubernetes backend, each with a way forward.

use miette::Diagnostic;
use thiserror::Error;

/// Where the least-privilege RBAC manifest lives (for namespace `ml`; `mflow kube rbac`
/// renders it for any namespace).
pub const RBAC_EXAMPLE: &str = "examples/kubernetes/rbac.yaml";

/// `in namespace "ml"`, or `(cluster-scoped)` for resources that have no namespace.
fn scope(namespace: &Option<String>) -> String {
    match namespace {
        Some(ns) => format!("in namespace {ns:?}"),
        None => "(cluster-scoped)".to_string(),
    }
}

#[derive(Debug, Error, Diagnostic)]
pub enum KubeError {
    #[error("cannot load the Kubernetes client configuration: {message}")]
    #[diagnostic(
        code(mflow::kube::config),
        help("set KUBECONFIG (or write ~/.kube/config), and `context` under [pipeline.kubernetes] to pick a context; inside a pod, mflow uses the pod's service account")
    )]
    Config { message: String },

    #[error("the Kubernetes API server at {url} is unreachable: {message}")]
    #[diagnostic(
        code(mflow::kube::unreachable),
        help("check that the cluster is running and that `kubectl --context <ctx> get ns` works from this machine")
    )]
    Unreachable { url: String, message: String },

    #[error("forbidden: cannot {verb} {resource} {}: {message}", scope(namespace))]
    #[diagnostic(
        code(mflow::kube::forbidden),
        help("grant the identity mflow runs as the rights mflow needs: `mflow kube rbac --namespace {rbac_namespace} --service-account mflow | kubectl apply -f -` (add --user NAME or --group NAME to bind a person)")
    )]
    Forbidden {
        verb: String,
        resource: String,
        /// `None` for a cluster-scoped resource.
        namespace: Option<String>,
        /// The namespace mflow works in, for the help.
        rbac_namespace: String,
        message: String,
    },

    #[error("the Kubeflow Trainer API (trainer.kubeflow.org/v1alpha1 {resource}) is not installed on this cluster")]
    #[diagnostic(
        code(mflow::kube::trainer_missing),
        help("install Kubeflow Trainer v2.3 (at least v2.2): see docs/kubernetes.md, `kubectl apply --server-side -k \"github.com/kubeflow/trainer.git/manifests/overlays/manager?ref=v2.3.0\"`")
    )]
    TrainerMissing { resource: String },

    #[error("Kubeflow Trainer on this cluster is too old: {found}; mflow needs v2.2 or newer (v2.3 recommended)")]
    #[diagnostic(
        code(mflow::kube::trainer_too_old),
        help("upgrade Kubeflow Trainer to v2.3; mflow relies on TrainJob `spec.runtimePatches`, which v2.2 introduced")
    )]
    TrainerTooOld { found: String },

    #[error("ClusterTrainingRuntime {name:?} does not exist (existing: {})", if available.is_empty() { "none".to_string() } else { available.join(", ") })]
    #[diagnostic(
        code(mflow::kube::runtime_missing),
        help("apply examples/kubernetes/runtime.yaml, or set the stage's runtime to one of the existing ClusterTrainingRuntimes")
    )]
    RuntimeMissing { name: String, available: Vec<String> },

    #[error("PersistentVolumeClaim {name:?} for mflow artifacts does not exist in namespace {namespace:?}")]
    #[diagnostic(
        code(mflow::kube::pvc_missing),
        help("create it with examples/kubernetes/pvc.yaml (ReadWriteMany), or point mflow at an existing claim")
    )]
    PvcMissing { name: String, namespace: String },

    #[error("the API server rejected {kind} {name:?} of stage {stage:?}: {message}")]
    #[diagnostic(
        code(mflow::kube::invalid_object),
        help("the server's message names the offending field; fix the stage's image, command, resources or runtime in the spec")
    )]
    Invalid { stage: String, kind: String, name: String, message: String },

    #[error("{kind} {name:?} already exists and was not created by mflow for this stage ({reason})")]
    #[diagnostic(
        code(mflow::kube::foreign_object),
        help("mflow never deletes objects it did not create: delete or rename it yourself (kubectl delete {kind_lower} {name}), or use another namespace", kind_lower = kind.to_lowercase())
    )]
    ForeignObject { kind: String, name: String, reason: String },

    #[error("stage {stage:?} sets environment variable {name}, which Kubeflow Trainer reserves")]
    #[diagnostic(
        code(mflow::kube::reserved_env),
        help("remove it: Trainer injects PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT itself and rejects TrainJobs that set them")
    )]
    ReservedEnv { stage: String, name: String },

    #[error("stage {stage:?} cannot run on Kubernetes: {field} {problem}")]
    #[diagnostic(code(mflow::kube::bad_request), help("fix `{field}` of the stage in the spec"))]
    BadRequest { stage: String, field: String, problem: String },

    #[error("workload file {path:?} cannot be shipped in a ConfigMap: {problem}")]
    #[diagnostic(
        code(mflow::kube::bad_workload),
        help("pass workload paths relative to the workloads root (like `mflow_workloads/train.py`) and keep the code under 700 kB; large files belong in the image")
    )]
    BadWorkload { path: String, problem: String },

    #[error("cache index entry {name:?} is unreadable: {message}")]
    #[diagnostic(
        code(mflow::kube::cache_corrupt),
        help("delete the ConfigMap (kubectl delete configmap {name}); the stage will run again and write a fresh entry")
    )]
    CacheCorrupt { name: String, message: String },

    #[error("Kubernetes API call failed: {verb} {resource} {name:?}: {message}")]
    #[diagnostic(
        code(mflow::kube::api),
        help("this is usually transient; if it persists, check the API server and the Trainer controller logs")
    )]
    Api { verb: String, resource: String, name: String, message: String },
}

impl KubeError {
    /// Maps a client error of one API call to the error that says what to do about it.
    /// `namespace` is `None` for cluster-scoped resources; `home` is the namespace mflow works in.
    pub(crate) fn from_call(
        err: kube::Error,
        verb: &str,
        resource: &str,
        name: &str,
        namespace: Option<&str>,
        home: &str,
        url: &str,
    ) -> KubeError {
        match err {
            kube::Error::Api(status) if (status.is_forbidden() && !is_admission_denial(&status)) || status.code == 401 => KubeError::Forbidden {
                verb: verb.to_string(),
                resource: resource.to_string(),
                namespace: namespace.map(str::to_string),
                rbac_namespace: home.to_string(),
                message: status.message.clone(),
            },
            kube::Error::Api(status) => KubeError::Api {
                verb: verb.to_string(),
                resource: resource.to_string(),
                name: name.to_string(),
                message: format!("{} ({}, HTTP {})", status.message, status.reason, status.code),
            },
            kube::Error::HyperError(_) | kube::Error::Service(_) => KubeError::Unreachable { url: url.to_string(), message: describe(&err) },
            other => KubeError::Api {
                verb: verb.to_string(),
                resource: resource.to_string(),
                name: name.to_string(),
                message: describe(&other),
            },
        }
    }
}

/// A client error in words: the server's message when it answered, else the chain of causes
/// (never the error's debug form).
pub fn describe(err: &kube::Error) -> String {
    if let kube::Error::Api(status) = err {
        return format!("{} ({}, HTTP {})", status.message, status.reason, status.code);
    }
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    text
}

/// A refusal by an admission webhook (Trainer's validator, say), whatever its HTTP code.
pub(crate) fn is_admission_denial(status: &kube::core::Status) -> bool {
    status.message.contains("admission webhook") && status.message.contains("denied the request")
}

/// The status carried by an API error, if the server answered at all.
pub(crate) fn api_status(err: &kube::Error) -> Option<&kube::core::Status> {
    match err {
        kube::Error::Api(status) => Some(status),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_described_in_words_not_debug_dumps() {
        let status = kube::core::Status::failure("pods \"p\" is forbidden: User \"nobody\" cannot get resource \"pods/log\"", "Forbidden").with_code(403);
        let text = describe(&kube::Error::Api(Box::new(status.clone())));
        assert_eq!(text, "pods \"p\" is forbidden: User \"nobody\" cannot get resource \"pods/log\" (Forbidden, HTTP 403)");
        assert!(!text.contains("Status {") && !text.contains("Some("), "{text}");
        // A webhook's refusal is about the object, not about the caller's rights.
        let denial = kube::core::Status::failure("admission webhook \"validator.trainjob.trainer.kubeflow.org\" denied the request: spec.trainer.env: Invalid value", "Forbidden").with_code(403);
        assert!(is_admission_denial(&denial));
        assert!(!is_admission_denial(&status));
        let e = KubeError::from_call(kube::Error::Api(Box::new(denial)), "create", "trainjobs", "x", Some("ml"), "ml", "https://127.0.0.1:6443");
        assert!(matches!(e, KubeError::Api { .. }), "{e:?}");
        // Cluster-scoped resources are not said to be in a namespace.
        let e = KubeError::from_call(kube::Error::Api(Box::new(status)), "get", "clustertrainingruntimes", "x", None, "ml", "u");
        assert_eq!(e.to_string().split(':').next().unwrap(), "forbidden");
        assert!(e.to_string().contains("clustertrainingruntimes (cluster-scoped)"), "{e}");
    }
}
