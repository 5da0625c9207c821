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
//! * Outputs: a TrainJob writes its output to a directory of its own on the volume,
//!   `<cache>/.kube/<trainjob>/out` (the engine's staging paths are rewritten to it in the
//!   command, the environment and the stage's config files), and mflow moves it into the
//!   engine's staging directory once the TrainJob completed. The engine clears staging
//!   directories of a key when a run starts; the TrainJob's own directory is named after the
//!   TrainJob, so it survives an mflow restart.
//! * Restart: an own TrainJob of the same attempt is reattached to (never submitted again);
//!   what it wrote before and after the restart is committed. One that completed while mflow
//!   was away is not run again; one whose output is gone is deleted and run afresh.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use miette::Diagnostic;
use mflow_kube::{CacheEntry, JobState, KubeBackend, KubeError, KubeOptions, LogLine, StageRequest, ARTIFACT_MOUNT};
use serde_json::{Map, Value as Json};
use thiserror::Error;
use tokio::sync::{mpsc, watch, OnceCell};
use tokio_util::sync::CancellationToken;

mod own_output;
pub mod render;
mod shown;

use own_output::OwnOutput;
use shown::ShownLines;

use super::{Cancel, Job, Line, Outcome};
use crate::exec::retry::FailureClass;
use crate::plan::Plan;
use crate::spec::{Resources, Spec, StageSpec};
use crate::stages::Kind;

const DEFAULT_CPU_RUNTIME: &str = "mflow-cpu";

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
    #[diagnostic(code(mflow::kubernetes::render), help("fix the stage in the spec; `mflow validate SPEC` checks it without a cluster"))]
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
            KubernetesError::Setting { .. }
            | KubernetesError::NoImage { .. }
            | KubernetesError::Render { .. } => FailureClass::User,
            _ => FailureClass::Infra,
        }
    }
}

/// The workdir of a pipeline on the kubernetes backend: `[pipeline] workdir` when it is
/// absolute, else `/mflow/<pipeline>` on the artifact volume.
pub fn default_workdir(spec: &mut Spec) {
    let explicit = toml::from_str::<toml::Table>(&spec.source)
        .ok()
        .and_then(|t| t.get("pipeline")?.get("workdir")?.as_str().map(PathBuf::from));
    if !explicit.is_some_and(|w| w.is_absolute()) {
        spec.pipeline.workdir = Path::new(ARTIFACT_MOUNT).join(&spec.pipeline.name);
    }
}

/// `engine = "auto"` of a train or evaluate stage, decided by the GPUs the stage requests
/// rather than by the machine running mflow: megatron with `resources.gpus > 0`, else the
/// reference engine. An explicit engine is kept.
pub fn choose_engine(stage: &mut StageSpec) {
    if !is_torch(stage.kind) {
        return;
    }
    let auto = stage.params.get("engine").is_none_or(|e| e.as_str() == Some("auto"));
    if auto {
        let engine = if stage.resources.gpus > 0 { "megatron" } else { "reference" };
        stage.params.insert("engine".into(), Json::String(engine.into()));
    }
}

/// What the adapter needs to know of a stage beyond its job.
pub(crate) struct StageInfo {
    kind: Kind,
    nodes: u32,
    image: Option<String>,
    resources: Resources,
}

pub(crate) struct Settings {
    image: Option<String>,
    train_image: Option<String>,
    runtime: String,
    cpu_runtime: String,
}

/// How the stages of one spec become TrainJob requests; needs no cluster.
pub(crate) struct Layout {
    pipeline: String,
    stages: BTreeMap<String, StageInfo>,
    settings: Settings,
    /// This binary's path: native stage commands run the image's `mflow` instead.
    exe: String,
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

/// Train and evaluate are torchrun jobs: they need the torch runtime's PET_* variables.
fn is_torch(kind: Kind) -> bool {
    matches!(kind, Kind::Train | Kind::Evaluate)
}

impl Kubernetes {
    /// Connects with the spec's `[pipeline.kubernetes]` settings (the kubeconfig comes from
    /// `KUBECONFIG`, `~/.kube/config` or the pod's service account) and checks, before any
    /// stage starts, that the cluster can run the plan.
    pub async fn connect(plan: &Plan) -> Result<Kubernetes, KubernetesError> {
        Self::connect_for(plan, mflow_kube::rbac::RULES).await
    }

    /// `connect`, checking the rights of `rules` (those of a run started outside the cluster).
    pub async fn connect_for(plan: &Plan, rules: &'static [mflow_kube::rbac::Rule]) -> Result<Kubernetes, KubernetesError> {
        let layout = Layout::of(plan)?;
        let kube = KubeBackend::connect(layout.options(&plan.spec)?).await?;
        kube.preflight_for(rules).await?;
        Ok(Kubernetes { kube, layout, workloads: OnceCell::new() })
    }

    /// The connection, for a run started outside the cluster that creates its driver with it.
    pub fn backend(&self) -> &KubeBackend {
        &self.kube
    }

    /// Connects without the preflight, for read-only questions such as `mflow plan`'s.
    pub async fn connect_read_only(spec: &Spec) -> Result<KubeBackend, KubernetesError> {
        let k = &spec.pipeline.kubernetes;
        let opts = KubeOptions { namespace: setting(k, "namespace")?, context: setting(k, "context")?, ..KubeOptions::default() };
        Ok(KubeBackend::connect(opts).await?)
    }

    pub async fn run(self: &Arc<Self>, job: &Job, lines: mpsc::UnboundedSender<Line>, cancel: watch::Receiver<Cancel>) -> Outcome {
        if let Some(dir) = job.log.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let log = match std::fs::File::create(&job.log) {
            Ok(f) => f,
            Err(e) => return Outcome::Failed { class: FailureClass::Infra, message: format!("cannot create log {}: {e}", job.log.display()) },
        };
        match self.attempt(job, log, lines, cancel).await {
            Ok(outcome) => outcome,
            Err(e) => Outcome::Failed { class: e.class(), message: e.explain() },
        }
    }

    async fn attempt(&self, job: &Job, log: std::fs::File, lines: mpsc::UnboundedSender<Line>, cancel: watch::Receiver<Cancel>) -> Result<Outcome, KubernetesError> {
        let info = self.layout.stages.get(&job.stage).ok_or_else(|| KubernetesError::UnknownStage { stage: job.stage.clone() })?;
        let digest = if info.kind.uses_python() { Some(self.ensure_workloads().await?) } else { None };
        let staged = PathBuf::from(job.env.get("MFLOW_OUTPUT").cloned().unwrap_or_default());
        let name = mflow_kube::trainjob_name(&self.layout.pipeline, &job.stage, &job.key, job.attempt);
        let own = OwnOutput::of(&staged, &name);
        let pod_job = own.as_ref().map(|o| o.rewrite(job)).transpose()?.unwrap_or_else(|| job.clone());
        let req = self.layout.request(&pod_job, info, digest)?;
        let status = self.prepare(&req, info.kind, own.as_ref()).await?.unwrap_or_else(|| job.status_file.clone());

        // Pod lines go to the attempt log and the display, as local output does. A reattached
        // TrainJob's containers are followed from their first line again: the attempt log gets
        // every line, the display only those an earlier mflow process did not show.
        let (tx, mut rx) = mpsc::channel::<LogLine>(1024);
        let stage = job.stage.clone();
        let mut shown = own.as_ref().map(|o| ShownLines::load(&o.dir));
        let pump = tokio::spawn(async move {
            let mut log = std::io::BufWriter::new(log);
            while let Some(line) = rx.recv().await {
                let text = line.to_string();
                let _ = writeln!(log, "{text}");
                let _ = log.flush();
                if shown.as_mut().is_none_or(|s| s.first_time(line.stream.as_deref())) {
                    let _ = lines.send(Line { stage: stage.clone(), text });
                }
            }
            if let Some(s) = shown.as_mut() {
                s.save();
            }
        });
        let (cancel_token, detach_token) = (CancellationToken::new(), CancellationToken::new());
        let bridge = {
            let (cancel_token, detach_token, mut cancel) = (cancel_token.clone(), detach_token.clone(), cancel);
            tokio::spawn(async move {
                // The first word counts: once interrupted, the TrainJob is left running.
                match cancel.wait_for(|c| *c != Cancel::None).await.map(|c| *c) {
                    Ok(Cancel::Detach) => detach_token.cancel(),
                    Ok(_) => cancel_token.cancel(),
                    Err(_) => {}
                }
            })
        };
        let result = self.kube.run_until(&req, tx, cancel_token, detach_token).await;
        bridge.abort();
        let _ = pump.await;
        let outcome = match result? {
            mflow_kube::Outcome::Detached { message } => Outcome::Detached { message },
            mflow_kube::Outcome::Succeeded => match own.as_ref().map(|o| o.deliver(&staged)) {
                Some(Err(message)) => Outcome::Failed { class: FailureClass::Infra, message },
                _ => Outcome::Success,
            },
            mflow_kube::Outcome::Failed { class, message } => {
                if let Some(o) = &own {
                    o.clear();
                }
                // The stage's own word (written on the shared volume) refines the pod's exit.
                match super::local::read_status(&status) {
                    Some((own, why)) if matches!(class, FailureClass::User | FailureClass::Infra) => Outcome::Failed { class: own, message: why },
                    _ => Outcome::Failed { class, message },
                }
            }
        };
        Ok(outcome)
    }

    /// Gets the TrainJob's own output directory ready and returns the status file of an own
    /// TrainJob left by an earlier mflow process (it writes where that process told it to).
    /// A fresh submission starts from an empty directory; a reattached TrainJob keeps what it
    /// wrote; a completed one whose output is gone is deleted, so that it runs again.
    async fn prepare(&self, req: &StageRequest, kind: Kind, own: Option<&OwnOutput>) -> Result<Option<PathBuf>, KubernetesError> {
        let existing = self.kube.existing(req).await?;
        let status = existing.as_ref().and_then(|e| e.env.get("MFLOW_STATUS")).map(PathBuf::from);
        let Some(own) = own else { return Ok(status) };
        let fresh = match existing.as_ref().map(|e| &e.state) {
            None | Some(JobState::Failed { .. }) => true,
            Some(JobState::Complete) if !own.out.is_dir() => {
                self.kube.forget(req).await?;
                true
            }
            Some(_) => false,
        };
        if fresh {
            own.clear();
        }
        // Native commands create `out` themselves (atomically, next to it); the others write
        // into it.
        let dir = if native(kind) { own.dir.clone() } else { own.out.clone() };
        std::fs::create_dir_all(&dir).map_err(|e| KubernetesError::Volume { path: dir.display().to_string(), message: e.to_string() })?;
        Ok(if fresh { None } else { status })
    }

    async fn ensure_workloads(&self) -> Result<String, KubernetesError> {
        let digest = self
            .workloads
            .get_or_try_init(|| async {
                let digest = crate::env::workloads_digest();
                self.kube.ensure_workloads(&digest, &workload_files()).await?;
                Ok::<_, KubernetesError>(digest)
            })
            .await?;
        Ok(digest.clone())
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
            Err(e) => Some(format!("cannot record the output in the cluster cache index: {}", KubernetesError::from(e).explain())),
        }
    }
}

impl Layout {
    /// The stages as planned, reshard stages that planning inserted included.
    pub(crate) fn of(plan: &Plan) -> Result<Layout, KubernetesError> {
        let spec = &plan.spec;
        let k = &spec.pipeline.kubernetes;
        let image = setting(k, "image")?;
        // `train_image` falls back to an explicit `image`, then to mflow's own GPU image.
        let train_image = setting(k, "train_image")?.or_else(|| image.clone()).unwrap_or_else(|| DEFAULT_TRAIN_IMAGE.into());
        let settings = Settings {
            image: Some(image.unwrap_or_else(|| DEFAULT_IMAGE.into())),
            train_image: Some(train_image),
            runtime: setting(k, "runtime")?.unwrap_or_else(|| mflow_kube::DEFAULT_RUNTIME.into()),
            cpu_runtime: setting(k, "cpu_runtime")?.unwrap_or_else(|| DEFAULT_CPU_RUNTIME.into()),
        };
        let stages: BTreeMap<String, StageInfo> = plan
            .stages
            .iter()
            .map(|p| &p.spec)
            .map(|s| {
                let info = StageInfo { kind: s.kind, nodes: s.nodes.max(1), image: s.image.clone(), resources: s.resources.clone() };
                (s.name.clone(), info)
            })
            .collect();
        let exe = crate::env::mflow_exe().map(|p| p.to_string_lossy().to_string()).unwrap_or_default();
        Ok(Layout { pipeline: spec.pipeline.name.clone(), stages, settings, exe })
    }

    /// Connection options from `[pipeline.kubernetes]`, with the runtimes the stages use.
    pub(crate) fn options(&self, spec: &Spec) -> Result<KubeOptions, KubernetesError> {
        let k = &spec.pipeline.kubernetes;
        let runtimes: BTreeSet<String> = self.stages.values().map(|s| runtime_of(&self.settings, s).to_string()).collect();
        let start_timeout = match setting(k, "start_timeout")? {
            Some(t) => humantime::parse_duration(&t).map_err(|_| KubernetesError::Setting { key: "start_timeout".into() })?,
            None => mflow_kube::DEFAULT_START_TIMEOUT,
        };
        Ok(KubeOptions {
            namespace: setting(k, "namespace")?,
            context: setting(k, "context")?,
            pvc: setting(k, "pvc")?.unwrap_or_else(|| mflow_kube::DEFAULT_PVC.into()),
            runtimes: runtimes.into_iter().collect(),
            start_timeout,
            ..KubeOptions::default()
        })
    }

    pub(crate) fn request(&self, job: &Job, info: &StageInfo, workload_digest: Option<String>) -> Result<StageRequest, KubernetesError> {
        let gpu_image = is_torch(info.kind) || (info.kind == Kind::Export && job.steps.len() > 1);
        let (setting, fallback) = if gpu_image { ("train_image", self.settings.train_image.clone()) } else { ("image", self.settings.image.clone()) };
        let image = info.image.clone().or(fallback).ok_or_else(|| KubernetesError::NoImage { stage: job.stage.clone(), setting: setting.into() })?;
        let steps: Vec<Vec<String>> = job.steps.iter().map(|argv| self.in_image(info.kind, argv)).collect();
        let mut command = match steps.as_slice() {
            [one] => one.clone(),
            many => vec!["sh".into(), "-c".into(), many.iter().map(|argv| shell_line(argv)).collect::<Vec<_>>().join(" && ")],
        };
        // A command stage runs in the spec's directory, as it does locally, where the pods see
        // that directory (a project on the volume).
        if info.kind == Kind::Command && job.cwd.starts_with(ARTIFACT_MOUNT) {
            let cwd = job.cwd.to_string_lossy().to_string();
            command = ["sh", "-c", "cd \"$0\" && exec \"$@\""].iter().map(|s| s.to_string()).chain([cwd]).chain(command).collect();
        }
        // The job's PET_* hold its topology as run locally, every rank on one node; on the
        // cluster the ranks split evenly over the stage's nodes (checked when the spec is).
        let pet = |k: &str| job.env.get(k).and_then(|n| n.parse::<u32>().ok()).unwrap_or(1);
        let nproc = (pet("PET_NNODES") * pet("PET_NPROC_PER_NODE") / info.nodes.max(1)).max(1);
        // Every rank of a CPU stage gets a core of its own unless the spec says how many the
        // pod gets (a node smaller than the ranks); GPU ranks need little CPU.
        let cpus = match (info.resources.cpus, info.resources.gpus) {
            (c, 0) if info.resources.cpus_given => c,
            (c, 0) => c.max(f64::from(nproc)),
            (c, _) if c > 0.0 => c,
            _ => f64::from(nproc),
        };
        // Trainer injects PET_*, the device plugin CUDA_VISIBLE_DEVICES, and the workload
        // ConfigMap PYTHONPATH; local values of those would be wrong in a pod.
        let env = job
            .env
            .iter()
            .filter(|(k, _)| !k.starts_with("PET_") && *k != "CUDA_VISIBLE_DEVICES" && !(workload_digest.is_some() && *k == "PYTHONPATH"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Ok(StageRequest {
            pipeline: self.pipeline.clone(),
            stage: job.stage.clone(),
            key: job.key.clone(),
            attempt: job.attempt,
            kind: info.kind.name().into(),
            image,
            command,
            env,
            num_nodes: info.nodes,
            nproc_per_node: nproc,
            gpus_per_node: info.resources.gpus,
            cpus: Some(cpu_quantity(cpus)),
            memory: info.resources.memory.clone(),
            runtime: runtime_of(&self.settings, info).to_string(),
            workload_digest,
            timeout: job.timeout,
        })
    }

    /// A step as the image runs it: `mflow` and `python` from the image's PATH, and torchrun
    /// taking its topology from Trainer's PET_* variables rather than local flags.
    fn in_image(&self, kind: Kind, argv: &[String]) -> Vec<String> {
        let Some((program, args)) = argv.split_first() else { return Vec::new() };
        if kind == Kind::Command {
            return argv.to_vec();
        }
        // The path the plan gave this binary: its own, or /proc/self/exe once it was replaced.
        if *program == self.exe || program == "/proc/self/exe" {
            return std::iter::once("mflow".to_string()).chain(args.iter().cloned()).collect();
        }
        if !kind.uses_python() {
            return argv.to_vec();
        }
        let torchrun = args.get(..2) == Some(&["-m".to_string(), "torch.distributed.run".to_string()][..]);
        const LOCAL_TOPOLOGY: &[&str] = &["--nnodes=", "--nproc-per-node=", "--node-rank=", "--master-addr=", "--master-port="];
        std::iter::once("python".to_string())
            .chain(args.iter().filter(|a| !(torchrun && LOCAL_TOPOLOGY.iter().any(|f| a.starts_with(f)))).cloned())
            .collect()
    }

}

fn native(kind: Kind) -> bool {
    !matches!(kind, Kind::Command | Kind::Train | Kind::Evaluate)
}

fn runtime_of<'a>(settings: &'a Settings, info: &StageInfo) -> &'a str {
    if is_torch(info.kind) || info.resources.gpus > 0 {
        &settings.runtime
    } else {
        &settings.cpu_runtime
    }
}

/// CPU request in Kubernetes quantity syntax: whole cores, or millicores.
fn cpu_quantity(cpus: f64) -> String {
    let cpus = if cpus > 0.0 { cpus } else { 1.0 };
    if cpus.fract() == 0.0 {
        format!("{}", cpus as u64)
    } else {
        format!("{}m", (cpus * 1000.0).round() as u64)
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

/// Quotes one argument for `sh -c`.
fn shell_quote(arg: &str) -> String {
    if !arg.is_empty() && arg.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b)) {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', "'\\''"))
    }
}

fn shell_line(argv: &[String]) -> String {
    argv.iter().map(|a| shell_quote(a)).collect::<Vec<_>>().join(" ")
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
    fn shell_lines_survive_quotes_and_spaces() {
        let argv = vec!["mflow".to_string(), "export".into(), "/mflow/a b".into(), "it's".into(), "".into()];
        assert_eq!(shell_line(&argv), r#"mflow export '/mflow/a b' 'it'\''s' ''"#);
    }

    #[test]
    fn cpu_quantities() {
        assert_eq!(cpu_quantity(2.0), "2");
        assert_eq!(cpu_quantity(0.5), "500m");
        assert_eq!(cpu_quantity(0.0), "1");
    }

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
