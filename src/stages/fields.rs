//! The keys of the spec's sections and those every stage accepts; each kind's own keys are in
//! its file (`stages::train::FIELDS`, ...). docs/spec.md documents the same keys.

use crate::spec::schema::{def, opt, req, Field, Ty, COUNT, NATURAL};

pub const RETRY: &[Field] = &[
    def("max", Ty::IntIn(0, 1000), "0", "attempts allowed after the first, per failure class"),
    def("backoff", Ty::Duration, "\"5s\"", "wait before the first retry; doubles each time, with jitter"),
    def("max_backoff", Ty::Duration, "\"5m\"", "cap on the wait between attempts"),
    def("on", Ty::StrList, "[\"infra\", \"timeout\"]", "failure classes that are retried: infra, user, oom, timeout"),
];

pub const RESOURCES: &[Field] = &[
    def("gpus", Ty::Int, "0", "GPUs per node; handed out as disjoint CUDA_VISIBLE_DEVICES sets"),
    def("cpus", Ty::Float, "1", "CPU cores the stage occupies in the local scheduler"),
    opt(
        "memory",
        Ty::Checked(memory),
        "memory request and limit on Kubernetes, a quantity not below zero, e.g. \"16Gi\" or \"512Mi\"",
    ),
];

/// The driver Job of a run started outside the cluster (`mflow run` where /mflow is not mounted).
pub const DRIVER: &[Field] = &[
    def(
        "service_account",
        Ty::Checked(service_account),
        "\"mflow\"",
        "service account the driver runs as; it needs mflow's RBAC (`mflow kube rbac`)",
    ),
    def(
        "restarts",
        Ty::IntIn(0, 1000),
        "3",
        "how often the driver starts again after an eviction or a node loss; it reattaches to running TrainJobs",
    ),
    def("host_network", Ty::Bool, "false", "run the driver (and the pod that uploads) in its node's network namespace"),
    opt(
        "env",
        Ty::Env(driver_env_reserved),
        "extra environment of the driver, e.g. KUBERNETES_SERVICE_HOST where the API server is reached another way; not `MFLOW_*` or `NO_COLOR`, which the run sets",
    ),
];

pub const KUBERNETES: &[Field] = &[
    opt("namespace", Ty::Checked(namespace), "namespace for TrainJobs (default: the kubeconfig's)"),
    opt("context", Ty::Str, "kubeconfig context"),
    def(
        "pvc",
        Ty::Checked(claim),
        "\"mflow-artifacts\"",
        "RWX PersistentVolumeClaim holding artifacts, mounted at /mflow",
    ),
    def(
        "image",
        Ty::Checked(image),
        concat!("\"", crate::image_repo!(), "-cpu:", env!("CARGO_PKG_VERSION"), "\""),
        "image with mflow for CPU stages (mflow's own, of this version)",
    ),
    def(
        "train_image",
        Ty::Checked(image),
        concat!("\"", crate::image_repo!(), ":", env!("CARGO_PKG_VERSION"), "\""),
        "image for GPU stages: torch and megatron-core (mflow's own, of this version)",
    ),
    def("runtime", Ty::Checked(runtime), "\"mflow-torch\"", "ClusterTrainingRuntime for GPU stages"),
    def("cpu_runtime", Ty::Checked(runtime), "\"mflow-cpu\"", "ClusterTrainingRuntime for CPU stages"),
    def(
        "start_timeout",
        Ty::Timeout,
        "\"15m\"",
        "how long a TrainJob may wait for its pods to start (Kueue queueing aside) before the attempt fails as infra",
    ),
    opt("driver", Ty::Table(DRIVER), "the driver Job of a run started outside the cluster"),
];

pub const PIPELINE: &[Field] = &[
    req("name", Ty::Str, "pipeline name; used in run records and Kubernetes object names"),
    opt("description", Ty::Str, "free text"),
    def("workdir", Ty::Str, "\".mflow\"", "run records and cache, relative to the spec's directory"),
    def("backend", Ty::Enum(&["local", "kubernetes"]), "\"local\"", "where stages run"),
    opt("retries", Ty::Table(RETRY), "default retry policy for every stage"),
    opt("timeout", Ty::Timeout, "default timeout for every stage"),
    opt("jobs", COUNT, "stages run at the same time (default: number of CPUs)"),
    opt("kubernetes", Ty::Table(KUBERNETES), "settings of the kubernetes backend"),
];

pub const ENV: &[Field] =
    &[opt("python", Ty::Str, "Python interpreter for workloads; skips provisioning (also MFLOW_PYTHON)")];

pub const SCHEDULE: &[Field] = &[
    req("cron", Ty::Str, "cron expression, e.g. \"0 3 * * *\""),
    opt("timezone", Ty::Str, "IANA time zone of the schedule"),
    def("service_account", Ty::Checked(service_account), "\"mflow\"", "service account the CronJob runs as"),
    def(
        "starting_deadline",
        Ty::Duration,
        "\"1h\"",
        "how late a missed run may still start; at least 10s, as the CronJob controller looks every 10 seconds",
    ),
    def("suspend", Ty::Bool, "false", "render the CronJob suspended"),
    opt(
        "secret",
        Ty::Checked(secret),
        "a Secret whose keys the scheduled run gets as environment variables (for `webhook = \"env:NAME\"`)",
    ),
];

pub const NOTIFY: &[Field] = &[
    req(
        "webhook",
        Ty::Checked(webhook),
        "http(s) URL that receives a JSON summary (POST), or env:NAME to read it from mflow's environment",
    ),
    def("on", Ty::StrList, "[\"success\", \"failure\"]", "when to notify"),
    def("timeout", Ty::Timeout, "\"10s\"", "per request"),
    def("retries", NATURAL, "3", "retries with exponential backoff"),
];

/// Keys every stage accepts, whatever its kind.
pub const COMMON: &[Field] = &[
    req("kind", Ty::Str, "command, model, convert, dataset, train, evaluate or export"),
    opt("description", Ty::Str, "free text"),
    def("needs", Ty::StrList, "[]", "stages that must finish first (references in values add edges too)"),
    def("inputs", Ty::StrList, "[]", "files or globs the stage reads, relative to the spec; their content enters the cache key (for `dataset`: the corpus, text or JSONL, gz and zst too). A symbolic link among them, or in a directory they name, must resolve inside the project (the git work tree, else the spec's directory) or the plan is refused (`mflow::plan::input_link_escapes`); an absolute path outside the project is read where it is, links in it staying inside it. mflow's workdir is never an input: a glob or directory passes it by, a path into it is refused"),
    opt("retries", Ty::Table(RETRY), "retry policy"),
    opt("timeout", Ty::Timeout, "kill the attempt after this long"),
    opt("resources", Ty::Table(RESOURCES), "resources the stage needs"),
    def("env", Ty::Env(stage_env_reserved), "{}", "extra environment variables (names of letters, digits and `_`; values of at most 128 KiB, 512 KiB in all); not credentials (`HF_TOKEN`, `*_API_KEY`, `*_PASSWORD`, ...), which a spec's records would keep: stages inherit them from mflow's own environment; not those mflow sets for each attempt (`MFLOW_OUTPUT`, `MFLOW_STAGE`, `MFLOW_INPUT_*`, ... in docs/environment.md) or torchrun's `PET_*`, which mflow and Kubeflow Trainer set"),
    def("cache", Ty::Bool, "true", "false: always rerun"),
    def("salt", Ty::Str, "\"\"", "any text; changing it invalidates the cache entry"),
    def("gates", Ty::StrMap, "{}", "conditions on metrics.json, e.g. val_ppl = \"< 40\""),
    def("nodes", Ty::IntIn(1, 65536), "1", "nodes (Kubernetes); train and evaluate split their ranks evenly over them, a command runs on each; model, convert, dataset and export run on one"),
    opt("image", Ty::Checked(image), "container image (Kubernetes)"),
];

/// A name the API server would refuse is refused when the spec is read (`render`, `plan`),
/// not when the cluster is asked.
fn kube_name(checked: Result<(), mflow_kube::KubeError>) -> Option<(String, String)> {
    let e = checked.err()?;
    let help = miette::Diagnostic::help(&e).map(|h| h.to_string()).unwrap_or_default();
    Some((e.to_string(), help))
}

fn namespace(name: &str) -> Option<(String, String)> {
    kube_name(mflow_kube::check_namespace(name))
}

fn service_account(name: &str) -> Option<(String, String)> {
    kube_name(mflow_kube::check_service_account(name))
}

fn claim(name: &str) -> Option<(String, String)> {
    kube_name(mflow_kube::check_claim(name))
}

fn runtime(name: &str) -> Option<(String, String)> {
    kube_name(mflow_kube::check_runtime(name))
}

/// A memory request the API server's schema and the kubelet both take.
fn memory(q: &str) -> Option<(String, String)> {
    let problem = mflow_kube::memory_problem(q)?;
    let help = "write bytes with a unit such as \"16Gi\", \"512Mi\" or \"1G\" (Ki, Mi, Gi, Ti, Pi, Ei are powers of 1024; k, M, G, T, P, E of 1000)";
    Some((format!("`{}` is not a memory quantity: {problem}", crate::spec::error::excerpt(q)), help.into()))
}

/// Why a stage's `env` may not set `name`: mflow sets it for each attempt (the stage's
/// contract, and the tag that finds its processes), or torchrun's topology, which mflow sets
/// for local ranks and Kubeflow Trainer in every pod (refusing a TrainJob that sets it).
fn stage_env_reserved(name: &str) -> Option<String> {
    use mflow_contract::vars::{Scope, ALL, ATTEMPT_TAG, INPUT_PREFIX};
    if name.starts_with("PET_") {
        return Some(
            "PET_* are torchrun's settings, which mflow gives the ranks here and Kubeflow Trainer in a pod".into(),
        );
    }
    let own = name.starts_with(INPUT_PREFIX)
        || name == ATTEMPT_TAG
        || ALL.iter().any(|v| v.scope == Scope::Stage && v.name == name);
    own.then(|| format!("mflow sets {name} for each attempt of a stage"))
}

/// Why the driver's `env` may not set `name`: the run that starts the driver gives it its own
/// settings (MFLOW_RUN_ID, MFLOW_PROJECT_ROOT, ...) and NO_COLOR, as its events are read back.
fn driver_env_reserved(name: &str) -> Option<String> {
    (name.starts_with("MFLOW_") || name == "NO_COLOR")
        .then(|| format!("the driver's {name} comes from the run that starts it, never from the spec"))
}

/// A webhook is an http(s) URL with a host; what it holds past the host is never shown.
fn webhook(url: &str) -> Option<(String, String)> {
    // `env:NAME`: the URL is read from mflow's environment when the run ends (docs/ci.md), so
    // that the secret stays out of the spec and its copies.
    if let Some(var) = url.strip_prefix("env:") {
        let ok = var.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && var.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        return (!ok).then(|| {
            (
                format!("`{}` is not an environment variable's name", crate::spec::error::excerpt(var)),
                "write env:NAME with letters, digits and `_`, e.g. env:MFLOW_WEBHOOK".into(),
            )
        });
    }
    match reqwest::Url::parse(url) {
        Ok(u) if matches!(u.scheme(), "http" | "https") && u.host_str().is_some_and(|h| !h.is_empty()) => None,
        Ok(u) => Some((
            format!("`{}` webhooks are not sent: only http and https", crate::spec::error::excerpt(u.scheme())),
            "write the URL as https://HOST/PATH, or env:NAME to read it from mflow's environment".into(),
        )),
        Err(e) => Some((
            format!("not a URL ({e})"),
            "write the URL as https://HOST/PATH, or env:NAME to read it from mflow's environment".into(),
        )),
    }
}

/// A Secret's name: an RFC 1123 subdomain, as a service account's.
fn secret(name: &str) -> Option<(String, String)> {
    service_account(name).map(|(why, _)| {
        (why.replace("service account", "Secret"), "name a Secret of the namespace: `kubectl get secrets`".into())
    })
}

/// An image reference a container runtime could pull: not empty, no spaces or control bytes.
fn image(r: &str) -> Option<(String, String)> {
    let bad = r.is_empty() || r.chars().any(|c| c.is_whitespace() || c.is_control());
    bad.then(|| {
        (
            format!("`{}` is not an image reference", crate::spec::error::excerpt(r)),
            "write REGISTRY/REPOSITORY:TAG, e.g. ghcr.io/org/image:1.0".into(),
        )
    })
}
