//! The Kubernetes backend: every attempt of a stage runs as a Kubeflow Trainer TrainJob through
//! `mflow_kube`. Artifacts live on the shared ReadWriteMany volume, mounted at `/mflow` in every
//! pod; mflow itself runs where it sees that volume at the same path (in the cluster, or on a
//! machine that mounts it there), so the paths the engine hands a stage are valid in its pods.
//!
//! * Workdir: `[pipeline] workdir` when it is absolute, else `/mflow/<pipeline>`.
//! * Image: the stage's `image`, else `[pipeline.kubernetes] train_image` for train, evaluate
//!   and a verified export, `image` for the rest. Native stages run the image's `mflow`, Python
//!   stages the image's `python` with the workload code of this mflow (a ConfigMap) first on
//!   `PYTHONPATH`; torchrun takes its topology from Trainer's `PET_*` variables.
//! * Runtime: `runtime` for train, evaluate and GPU stages, `cpu_runtime` for the rest.
//! * Pods start in the image's working directory, and files a stage reads (inputs, `path:`
//!   models) must be on the volume too: relative paths in the spec resolve against the spec's
//!   directory, so keep the spec on the volume or use absolute paths below `/mflow`.
//! * Outputs: an attempt's area is the directory of its TrainJob on the volume,
//!   `<cache>/.kube/<trainjob>` (`attempt_area`), said before the job is built: the command,
//!   the environment and the stage's config files name `<cache>/.kube/<trainjob>/out` as the
//!   output and its reports beside it, and the engine commits the cache entry from there once
//!   the TrainJob completed. The directory is named after the TrainJob, so it survives an
//!   mflow restart; the engine's own staging directories of a key are cleared when a run
//!   starts.
//! * Restart: an own TrainJob of the same attempt is reattached to (never submitted again);
//!   what it wrote before and after the restart is committed. One that completed while mflow
//!   was away is not run again; one whose output is gone is deleted and run afresh.

use std::collections::BTreeMap;
use std::path::Path;

use mflow_kube::{CacheEntry, KubeBackend, KubeError, KubeOptions, ARTIFACT_MOUNT};
use miette::Diagnostic;
use serde_json::{Map, Value as Json};
use thiserror::Error;
use tokio::sync::OnceCell;

mod adapter;
mod layout;
pub mod outside;
pub mod render;
mod shown;

use crate::backend::AttemptArea;
use crate::plan::Plan;
use crate::spec::Spec;
use layout::Layout;
use mflow_contract::FailureClass;

/// The repository of mflow's own images (docker/Dockerfile); a literal, for `concat!`.
#[macro_export]
macro_rules! image_repo {
    () => {
        "ghcr.io/mflow-dev/mflow"
    };
}
/// Images of this mflow version, used when the spec names none: `image` and `train_image`.
pub const DEFAULT_IMAGE: &str = concat!(image_repo!(), "-cpu:", env!("CARGO_PKG_VERSION"));
pub const DEFAULT_TRAIN_IMAGE: &str = concat!(image_repo!(), ":", env!("CARGO_PKG_VERSION"));

#[derive(Debug, Error, Diagnostic)]
pub enum KubernetesError {
    #[error(transparent)]
    #[diagnostic(transparent)]
    Kube(#[from] KubeError),

    #[error("[pipeline.kubernetes] {key} must be a string (a duration such as \"10m\" for timeouts)")]
    #[diagnostic(code(mflow::kubernetes::setting), help("write `{key} = \"...\"` under [pipeline.kubernetes]"))]
    Setting { key: String },

    #[error("stage `{stage}` has no container image")]
    #[diagnostic(
        code(mflow::kubernetes::no_image),
        help("set `{setting}` under [pipeline.kubernetes], or `image` on the stage; the image must contain mflow (and Python with torch for train, evaluate and export)")
    )]
    NoImage { stage: String, setting: String },

    #[error("cannot prepare {path} on the artifact volume: {message}")]
    #[diagnostic(
        code(mflow::kubernetes::volume),
        help("mflow must see the artifact volume read-write at the same path as the pods (/mflow); check the mount and its free space")
    )]
    Volume { path: String, message: String },

    #[error("cannot shape stage `{stage}` as a TrainJob: {message}")]
    #[diagnostic(
        code(mflow::kubernetes::render),
        help("fix the stage in the spec; `mflow validate SPEC` checks it without a cluster")
    )]
    Render { stage: String, message: String },

    #[error("stage `{stage}` is not part of the plan this backend was built for")]
    #[diagnostic(code(mflow::kubernetes::unknown_stage), help("this is a bug in mflow; please report it"))]
    UnknownStage { stage: String },
}

impl KubernetesError {
    /// The error and its way forward on one line, for a stage's failure message.
    pub fn explain(&self) -> String {
        match self.help() {
            Some(help) => format!("{self} (help: {help})"),
            None => self.to_string(),
        }
    }

    /// The failure class of an attempt that ended with this error: configuration a user must
    /// fix, or a cluster that did not do its part.
    pub fn class(&self) -> FailureClass {
        match self {
            KubernetesError::Kube(k) if k.is_users_to_fix() => FailureClass::User,
            KubernetesError::Setting { .. } | KubernetesError::NoImage { .. } | KubernetesError::Render { .. } => {
                FailureClass::User
            }
            _ => FailureClass::Infra,
        }
    }
}

/// Whether a kubernetes run of `spec` is started outside the cluster: its workdir is on the
/// artifact volume, which this machine does not mount. An explicit absolute workdir elsewhere
/// says the volume is mounted there (a shared file system), and the engine runs here.
pub fn outside_cluster(spec: &Spec) -> bool {
    let mount = Path::new(ARTIFACT_MOUNT);
    spec.workdir().starts_with(mount) && !mount.is_dir()
}

pub struct Kubernetes {
    kube: KubeBackend,
    layout: Layout,
    /// Digest of the workload ConfigMap, created once per run when a Python stage first runs.
    workloads: OnceCell<String>,
}

fn setting(map: &Map<String, Json>, key: &str) -> Result<Option<String>, KubernetesError> {
    match map.get(key) {
        None => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(KubernetesError::Setting { key: key.into() }),
    }
}

impl Kubernetes {
    /// Connects with the spec's `[pipeline.kubernetes]` settings (the kubeconfig comes from
    /// `KUBECONFIG`, `~/.kube/config` or the pod's service account) and checks, before any
    /// stage starts, that the cluster can run the plan.
    pub async fn connect(plan: &Plan) -> Result<Kubernetes, KubernetesError> {
        Self::connect_for(plan, mflow_kube::rbac::RULES).await
    }

    /// `connect`, checking the rights of `rules` (those of a run started outside the cluster).
    pub async fn connect_for(
        plan: &Plan,
        rules: &'static [mflow_kube::rbac::Rule],
    ) -> Result<Kubernetes, KubernetesError> {
        let layout = Layout::of(plan)?;
        let kube = KubeBackend::connect(layout.options(&plan.spec)?).await?;
        kube.preflight_for(rules).await?;
        Ok(Kubernetes { kube, layout, workloads: OnceCell::new() })
    }

    /// The area of attempt `attempt` of `stage` at `key`: the directory of its TrainJob,
    /// `<cache>/.kube/<trainjob>`, which outlives this process.
    pub fn attempt_area(&self, workdir: &crate::workdir::Workdir, stage: &str, key: &str, attempt: u32) -> AttemptArea {
        self.layout.attempt_area(workdir, stage, key, attempt)
    }

    /// The connection, for a run started outside the cluster that creates its driver with it.
    pub fn backend(&self) -> &KubeBackend {
        &self.kube
    }

    /// Connects without the preflight, for read-only questions such as `mflow plan`'s.
    pub async fn connect_read_only(spec: &Spec) -> Result<KubeBackend, KubernetesError> {
        let k = &spec.pipeline.kubernetes;
        let opts = KubeOptions {
            namespace: setting(k, "namespace")?,
            context: setting(k, "context")?,
            ..KubeOptions::default()
        };
        Ok(KubeBackend::connect(opts).await?)
    }

    /// Records a committed output in the cluster's cache index; returns a warning on failure
    /// (the local commit stands either way).
    pub async fn committed(&self, key: &str, stage: &str, output: &Path, digest: &str) -> Option<String> {
        let kind = self.layout.stages.get(stage).map(|s| s.kind.name()).unwrap_or("command");
        let entry = CacheEntry {
            stage: stage.into(),
            kind: kind.into(),
            output: volume_relative(output),
            digest: Some(digest.into()),
            bytes: dir_bytes(output),
            created: crate::record::now(),
            extra: BTreeMap::new(),
        };
        match self.kube.cache_put(&self.layout.pipeline, key, &entry).await {
            Ok(()) => None,
            Err(e) => Some(format!(
                "cannot record the output in the cluster cache index: {}",
                KubernetesError::from(e).explain()
            )),
        }
    }
}

/// A path on the artifact volume as the cache index stores it: relative to the mount.
fn volume_relative(path: &Path) -> String {
    match path.strip_prefix(ARTIFACT_MOUNT) {
        Ok(rel) => rel.display().to_string(),
        Err(_) => path.display().to_string(),
    }
}

fn dir_bytes(dir: &Path) -> Option<u64> {
    fn walk(p: &Path) -> u64 {
        std::fs::read_dir(p)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| match e.file_type() {
                Ok(t) if t.is_dir() => walk(&e.path()),
                _ => e.metadata().map(|m| m.len()).unwrap_or(0),
            })
            .sum()
    }
    dir.is_dir().then(|| walk(dir))
}

/// The embedded workload package, keyed by path below the workloads root.
fn workload_files() -> BTreeMap<String, String> {
    fn walk(dir: &include_dir::Dir<'_>, out: &mut BTreeMap<String, String>) {
        for f in dir.files() {
            let path = f.path().to_string_lossy().to_string();
            if path.ends_with(".pyc") {
                continue;
            }
            if let Some(text) = f.contents_utf8() {
                out.insert(format!("mflow_workloads/{path}"), text.to_string());
            }
        }
        for sub in dir.dirs() {
            let name = sub.path().file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
            if name != "__pycache__" && name != "tests" {
                walk(sub, out);
            }
        }
    }
    let mut files = BTreeMap::new();
    walk(&crate::env::WORKLOADS, &mut files);
    files
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_paths_are_relative_to_the_mount() {
        assert_eq!(volume_relative(Path::new("/mflow/p/cache/k/out")), "p/cache/k/out");
        assert_eq!(volume_relative(Path::new("/elsewhere/out")), "/elsewhere/out");
    }

    #[test]
    fn workloads_ship_as_utf8_files_below_their_package() {
        let files = workload_files();
        assert!(files.contains_key("mflow_workloads/train.py"), "{:?}", files.keys().collect::<Vec<_>>());
        assert!(files.keys().all(|k| k.starts_with("mflow_workloads/") && !k.contains("__pycache__")));
    }
}
