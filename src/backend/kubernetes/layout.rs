//! How the stages of one spec become TrainJob requests, with no cluster: images, runtimes,
//! commands as the image runs them, resources.

use std::collections::{BTreeMap, BTreeSet};

use mflow_kube::{KubeOptions, StageRequest, ARTIFACT_MOUNT};

use super::{setting, KubernetesError, DEFAULT_IMAGE, DEFAULT_TRAIN_IMAGE};
use crate::backend::{AttemptArea, Job};
use crate::plan::Plan;
use crate::spec::{Resources, Spec};
use crate::stages::Kind;

const DEFAULT_CPU_RUNTIME: &str = "mflow-cpu";

/// What the adapter needs to know of a stage beyond its job.
pub(crate) struct StageInfo {
    pub(super) kind: Kind,
    pub(super) nodes: u32,
    pub(super) image: Option<String>,
    pub(super) resources: Resources,
}

pub(crate) struct Settings {
    image: Option<String>,
    train_image: Option<String>,
    runtime: String,
    cpu_runtime: String,
}

/// How the stages of one spec become TrainJob requests; needs no cluster.
pub(crate) struct Layout {
    pub(super) pipeline: String,
    pub(super) stages: BTreeMap<String, StageInfo>,
    settings: Settings,
    /// This binary's path: native stage commands run the image's `mflow` instead.
    exe: String,
}

impl Layout {
    /// The stages as planned, reshard stages that planning inserted included.
    pub(crate) fn of(plan: &Plan) -> Result<Layout, KubernetesError> {
        let spec = &plan.spec;
        let k = &spec.pipeline.kubernetes;
        let image = setting(k, "image")?;
        // `train_image` falls back to an explicit `image`, then to mflow's own GPU image.
        let train_image =
            setting(k, "train_image")?.or_else(|| image.clone()).unwrap_or_else(|| DEFAULT_TRAIN_IMAGE.into());
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
                let info = StageInfo {
                    kind: s.kind,
                    nodes: s.nodes.max(1),
                    image: s.image.clone(),
                    resources: s.resources.clone(),
                };
                (s.name.clone(), info)
            })
            .collect();
        let exe = crate::env::mflow_exe().map(|p| p.to_string_lossy().to_string()).unwrap_or_default();
        Ok(Layout { pipeline: spec.pipeline.name.clone(), stages, settings, exe })
    }

    /// Where attempt `attempt` of `stage` at `key` writes: the directory of its TrainJob.
    pub(crate) fn attempt_area(
        &self,
        workdir: &crate::workdir::Workdir,
        stage: &str,
        key: &str,
        attempt: u32,
    ) -> AttemptArea {
        workdir.trainjob_attempt(&mflow_kube::trainjob_name(&self.pipeline, stage, key, attempt))
    }

    /// Connection options from `[pipeline.kubernetes]`, with the runtimes the stages use.
    pub(crate) fn options(&self, spec: &Spec) -> Result<KubeOptions, KubernetesError> {
        let k = &spec.pipeline.kubernetes;
        let runtimes: BTreeSet<String> =
            self.stages.values().map(|s| runtime_of(&self.settings, s).to_string()).collect();
        let start_timeout = match setting(k, "start_timeout")? {
            Some(t) => {
                humantime::parse_duration(&t).map_err(|_| KubernetesError::Setting { key: "start_timeout".into() })?
            }
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

    pub(crate) fn request(
        &self,
        job: &Job,
        info: &StageInfo,
        workload_digest: Option<String>,
    ) -> Result<StageRequest, KubernetesError> {
        let gpu_image = info.kind.is_distributed() || (info.kind == Kind::Export && job.steps.len() > 1);
        let (setting, fallback) = if gpu_image {
            ("train_image", self.settings.train_image.clone())
        } else {
            ("image", self.settings.image.clone())
        };
        let image = info
            .image
            .clone()
            .or(fallback)
            .ok_or_else(|| KubernetesError::NoImage { stage: job.stage.clone(), setting: setting.into() })?;
        let steps: Vec<Vec<String>> = job.steps.iter().map(|argv| self.in_image(info.kind, argv)).collect();
        let mut command = match steps.as_slice() {
            [one] => one.clone(),
            many => vec![
                "sh".into(),
                "-c".into(),
                many.iter().map(|argv| shell_line(argv)).collect::<Vec<_>>().join(" && "),
            ],
        };
        // A command stage runs in the spec's directory, as it does locally, where the pods see
        // that directory (a project on the volume).
        if info.kind == Kind::Command && job.cwd.starts_with(ARTIFACT_MOUNT) {
            let cwd = job.cwd.to_string_lossy().to_string();
            command = ["sh", "-c", "cd \"$0\" && exec \"$@\""]
                .iter()
                .map(|s| s.to_string())
                .chain([cwd])
                .chain(command)
                .collect();
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
            .filter(|(k, _)| {
                !k.starts_with("PET_")
                    && *k != "CUDA_VISIBLE_DEVICES"
                    && !(workload_digest.is_some() && *k == "PYTHONPATH")
            })
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
        const LOCAL_TOPOLOGY: &[&str] =
            &["--nnodes=", "--nproc-per-node=", "--node-rank=", "--master-addr=", "--master-port="];
        std::iter::once("python".to_string())
            .chain(args.iter().filter(|a| !(torchrun && LOCAL_TOPOLOGY.iter().any(|f| a.starts_with(f)))).cloned())
            .collect()
    }
}

fn runtime_of<'a>(settings: &'a Settings, info: &StageInfo) -> &'a str {
    if info.kind.is_distributed() || info.resources.gpus > 0 {
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
}
