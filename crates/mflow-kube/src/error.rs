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

/// The cluster and identity mflow talks to, as the kubeconfig names them, for errors that
/// must say whose credentials or which server (never the credentials themselves).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Target {
    /// The API server's URL.
    pub url: String,
    /// The kubeconfig context; `None` in a pod (its service account) or for a given client.
    pub context: Option<String>,
    /// The kubeconfig user of the context.
    pub user: Option<String>,
    /// The kubeconfig cluster of the context.
    pub cluster: Option<String>,
    /// The kubeconfig file(s) the context came from.
    pub kubeconfig: Option<String>,
    /// True for the in-cluster configuration (the pod's service account).
    pub in_cluster: bool,
}

impl Target {
    /// `context "dev" (user "alice")`, or `the pod's service account`.
    pub fn who(&self) -> String {
        match (&self.context, &self.user) {
            (Some(c), Some(u)) => format!("context {c:?} (user {u:?})"),
            (Some(c), None) => format!("context {c:?}"),
            _ if self.in_cluster => "the pod's service account".to_string(),
            _ => "the configured client".to_string(),
        }
    }

    /// `the Kubernetes API server at URL`, or without the URL when it is not known.
    pub fn server(&self) -> String {
        if self.url.is_empty() {
            "the Kubernetes API server".to_string()
        } else {
            format!("the Kubernetes API server at {}", self.url)
        }
    }

    /// How to name the context in a command line: `--context dev`, or nothing.
    fn context_flag(&self) -> String {
        self.context.as_ref().map(|c| format!(" --context {c}")).unwrap_or_default()
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

    #[error("cannot read the kubeconfig {path}: {message}")]
    #[diagnostic(
        code(mflow::kube::kubeconfig),
        help("point KUBECONFIG at a kubeconfig file that exists and is valid YAML (`kubectl config view` reads the same files), or unset it to use ~/.kube/config")
    )]
    Kubeconfig { path: String, message: String },

    #[error("{} (contexts: {})", if context.is_empty() { "the kubeconfig names no current context".to_string() } else { format!("the kubeconfig has no context {context:?}") }, if available.is_empty() { "none".to_string() } else { available.join(", ") })]
    #[diagnostic(
        code(mflow::kube::unknown_context),
        help("set `context` under [pipeline.kubernetes] (or --context) to one of the contexts of {kubeconfig}; `kubectl config get-contexts` lists them")
    )]
    UnknownContext { context: String, available: Vec<String>, kubeconfig: String },

    #[error("cannot use the credentials of {who}: {message}")]
    #[diagnostic(
        code(mflow::kube::credentials),
        help("fix the user's entry in the kubeconfig (its token file, client certificate or exec plugin): `kubectl config view --minify{context_flag}` shows it")
    )]
    Credentials { who: String, context_flag: String, message: String },

    #[error("{server} rejected the credentials of {who} (HTTP 401: {message})")]
    #[diagnostic(
        code(mflow::kube::unauthorized),
        help("the token or client certificate is wrong, expired, or belongs to a ServiceAccount that was deleted: get fresh credentials for this user (for a ServiceAccount, `kubectl create token NAME`), or choose another context with `context` under [pipeline.kubernetes] or --context; `kubectl{context_flag} auth whoami` shows what the server thinks of them")
    )]
    Unauthorized { server: String, who: String, context_flag: String, message: String },

    #[error("the certificate of {server} is not trusted ({who}): {message}")]
    #[diagnostic(
        code(mflow::kube::untrusted_certificate),
        help("the cluster's certificate-authority (or certificate-authority-data) in the kubeconfig is not the CA that signed the server's certificate, or `server` names another server: take both from the cluster's own kubeconfig (`kubectl config view --minify --raw{context_flag}`)")
    )]
    UntrustedCertificate { server: String, who: String, context_flag: String, message: String },

    #[error("the Kubernetes API server at {url} is unreachable: {message}")]
    #[diagnostic(
        code(mflow::kube::unreachable),
        help("check that the cluster is running and that `kubectl{context_flag} get ns` works from this machine")
    )]
    Unreachable { url: String, context_flag: String, message: String },

    #[error("namespace {namespace:?} does not exist on the cluster at {url}")]
    #[diagnostic(
        code(mflow::kube::namespace_missing),
        help("create it (`kubectl create namespace {namespace}`, then the claim and RBAC of examples/kubernetes/), or choose an existing one: `namespace` under [pipeline.kubernetes], --namespace, or the namespace of the kubeconfig context")
    )]
    NamespaceMissing { namespace: String, url: String },

    #[error("{what} {name:?} is {} characters long; Kubernetes allows at most {limit}", name.len())]
    #[diagnostic(code(mflow::kube::name_too_long), help("{help}"))]
    NameTooLong { what: String, name: String, limit: usize, help: String },

    #[error("{what} {name:?} is not a valid Kubernetes name: {problem}")]
    #[diagnostic(code(mflow::kube::invalid_name), help("{help}"))]
    InvalidName { what: String, name: String, problem: String, help: String },

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
        help(
            "upgrade Kubeflow Trainer to v2.3; mflow relies on TrainJob `spec.runtimePatches`, which v2.2 introduced"
        )
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
        help(
            "delete the ConfigMap (kubectl delete configmap {name}); the stage will run again and write a fresh entry"
        )
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
        target: &Target,
    ) -> KubeError {
        if let Some(e) = KubeError::of_connection(&err, target) {
            return e;
        }
        match err {
            kube::Error::Api(status)
                if status.code == 404
                    && missing_namespace(&status).is_some_and(|ns| namespace.is_none_or(|n| n == ns)) =>
            {
                KubeError::NamespaceMissing {
                    namespace: missing_namespace(&status).unwrap_or(home).to_string(),
                    url: target.url.clone(),
                }
            }
            kube::Error::Api(status) if status.is_forbidden() && !is_admission_denial(&status) => {
                KubeError::Forbidden {
                    verb: verb.to_string(),
                    resource: resource.to_string(),
                    namespace: namespace.map(str::to_string),
                    rbac_namespace: home.to_string(),
                    message: status.message.clone(),
                }
            }
            kube::Error::Api(status) => KubeError::Api {
                verb: verb.to_string(),
                resource: resource.to_string(),
                name: name.to_string(),
                message: format!("{} ({}, HTTP {})", status.message, status.reason, status.code),
            },
            other => KubeError::Api {
                verb: verb.to_string(),
                resource: resource.to_string(),
                name: name.to_string(),
                message: describe(&other),
            },
        }
    }

    /// The errors of reaching the server at all, whatever the call: rejected credentials (401),
    /// an untrusted certificate, credentials that cannot be loaded, no answer. `None` when the
    /// server answered about the call itself.
    pub fn of_connection(err: &kube::Error, target: &Target) -> Option<KubeError> {
        let (url, server, who, context_flag) =
            (target.url.clone(), target.server(), target.who(), target.context_flag());
        match err {
            kube::Error::Api(status) if status.code == 401 => {
                // The server's own words ("Unauthorized"); a request's token never appears in them.
                let message = if status.message.is_empty() { status.reason.clone() } else { status.message.clone() };
                Some(KubeError::Unauthorized { server, who, context_flag, message })
            }
            kube::Error::Api(_) => None,
            kube::Error::Auth(_) => Some(KubeError::Credentials { who, context_flag, message: describe(err) }),
            _ => match untrusted_certificate(err) {
                Some(message) => Some(KubeError::UntrustedCertificate { server, who, context_flag, message }),
                None if matches!(err, kube::Error::HyperError(_) | kube::Error::Service(_)) => {
                    Some(KubeError::Unreachable { url, context_flag, message: describe(err) })
                }
                None => None,
            },
        }
    }

    /// Whether the user must fix something before trying again (exit 2), rather than wait for
    /// the cluster (exit 3): the kubeconfig, the credentials, the certificate, the namespace,
    /// a name, or the request itself.
    pub fn is_users_to_fix(&self) -> bool {
        matches!(
            self,
            KubeError::Config { .. }
                | KubeError::Kubeconfig { .. }
                | KubeError::UnknownContext { .. }
                | KubeError::Credentials { .. }
                | KubeError::Unauthorized { .. }
                | KubeError::UntrustedCertificate { .. }
                | KubeError::NamespaceMissing { .. }
                | KubeError::NameTooLong { .. }
                | KubeError::InvalidName { .. }
                | KubeError::Invalid { .. }
                | KubeError::BadRequest { .. }
                | KubeError::ReservedEnv { .. }
                | KubeError::ForeignObject { .. }
                | KubeError::BadWorkload { .. }
        )
    }
}

/// The namespace a 404 says is missing: creating in a namespace that does not exist answers
/// `namespaces "x" not found` (details kind `namespaces`), whatever the object.
fn missing_namespace(status: &kube::core::Status) -> Option<&str> {
    let details = status.details.as_ref()?;
    (details.kind == "namespaces" && details.group.is_empty() && !details.name.is_empty())
        .then_some(details.name.as_str())
}

/// The TLS verifier's words when the server's certificate was refused, from anywhere in the
/// error's chain of causes.
fn untrusted_certificate(err: &kube::Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(cause) = source {
        // An I/O error hides the error it wraps from `source()`.
        let inner = cause
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .map(|e| e as &(dyn std::error::Error + 'static));
        for e in [Some(cause), inner].into_iter().flatten() {
            if let Some(tls @ rustls::Error::InvalidCertificate(_)) = e.downcast_ref::<rustls::Error>() {
                return Some(tls.to_string());
            }
        }
        source = inner.and_then(|i| i.source()).or_else(|| cause.source());
    }
    // The connector may carry the verifier's error as text only; rustls words it this way.
    let text = chain(err);
    text.find("invalid peer certificate").map(|at| text[at..].to_string())
}

/// A client error in words: the server's message when it answered, else the chain of causes
/// (never the error's debug form).
pub fn describe(err: &kube::Error) -> String {
    if let kube::Error::Api(status) = err {
        return format!("{} ({}, HTTP {})", status.message, status.reason, status.code);
    }
    chain(err)
}

/// An error and its causes, each said once.
pub(crate) fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
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
mod tests;
