//! From a planned stage to the commands that produce its output: what every kind's `job`
//! shares (the context of an attempt, the workloads' environment, torchrun).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mflow_contract::workload::Engine;
use serde_json::Value as Json;

use super::{EngineChoice, Kind, Params};
use crate::env::Environment;
use crate::spec::StageSpec;

pub struct JobContext<'a> {
    pub stage: &'a StageSpec,
    /// The engine chosen at plan time, for the kinds that have one.
    pub engine: Option<&'a EngineChoice>,
    pub output: &'a Path,
    pub scratch: &'a Path,
    /// Where the attempt's files go (configs of the workloads), as the job names them.
    pub attempt_dir: &'a Path,
    /// Where those files are written when not in `attempt_dir` itself: `mflow render` names
    /// them where a run keeps them and writes them to a temporary directory.
    pub config_dir: Option<&'a Path>,
    pub attempt: u32,
    pub spec_dir: &'a Path,
    pub env: &'a Environment,
    /// Upstream stage name -> committed output directory.
    pub upstream: &'a BTreeMap<String, PathBuf>,
    pub gpus: &'a [String],
    pub cpus: f64,
}

pub struct JobPlan {
    pub steps: Vec<Vec<String>>,
    pub env: BTreeMap<String, String>,
    pub cwd: PathBuf,
    /// Native commands create their output directory themselves (atomically).
    pub output_created_by_stage: bool,
}

/// The commands of one attempt of the stage.
pub fn build_job(cx: &JobContext<'_>) -> Result<JobPlan, String> {
    let mut plan = match &cx.stage.typed {
        Params::Command(p) => p.job(cx),
        Params::Model(p) => p.job(cx)?,
        Params::Convert(p) => p.job(cx)?,
        Params::Dataset(p) => p.job(cx)?,
        Params::Train(p) => p.job(cx)?,
        Params::Evaluate(p) => p.job(cx)?,
        Params::Export(p) => p.job(cx)?,
    };
    if cx.stage.kind.uses_python() {
        plan.env.extend(python_env(cx.env).map_err(|e| e.to_string())?);
    }
    if !cx.gpus.is_empty() {
        plan.env.insert("CUDA_VISIBLE_DEVICES".into(), cx.gpus.join(","));
    } else if cx.stage.kind.is_distributed() && cx.engine_name() == "reference" {
        // The reference engine runs on CPU: no rank may pick up a GPU it was not given.
        plan.env.insert("CUDA_VISIBLE_DEVICES".into(), String::new());
    }
    Ok(plan)
}

impl JobContext<'_> {
    /// `s` with every `${stages.NAME.output}` replaced by that stage's committed output.
    pub fn resolve(&self, s: &str) -> String {
        let resolved = crate::spec::substitute_outputs(&Json::String(s.to_string()), &|n| {
            self.upstream.get(n).map(|p| p.display().to_string()).unwrap_or_default()
        });
        resolved.as_str().unwrap_or(s).to_string()
    }

    /// `path` made absolute against the spec's directory.
    pub fn absolute(&self, path: &str) -> String {
        let p = Path::new(path);
        if p.is_absolute() {
            path.to_string()
        } else {
            self.spec_dir.join(p).to_string_lossy().to_string()
        }
    }

    pub fn output(&self) -> String {
        self.output.to_string_lossy().to_string()
    }

    /// This mflow, which runs the native kinds.
    pub fn mflow(&self) -> Result<String, String> {
        let exe = crate::env::mflow_exe().map_err(|e| format!("cannot locate the mflow binary: {e}"))?;
        Ok(exe.to_string_lossy().to_string())
    }

    pub fn python(&self) -> Result<String, String> {
        Ok(self.env.python().map_err(|e| e.to_string())?.to_string_lossy().to_string())
    }

    pub fn engine_name(&self) -> &str {
        self.engine.map_or("", |e| e.name.as_str())
    }

    /// The engine chosen for a train or evaluate stage, as its workload reads it.
    pub fn engine(&self) -> Result<Engine, String> {
        match self.engine_name() {
            "megatron" => Ok(Engine::Megatron),
            "reference" => Ok(Engine::Reference),
            other => Err(format!("no engine `{other}` was chosen for stage `{}`", self.stage.name)),
        }
    }

    /// Writes a workload's config as `<name>-<attempt>.json` into the attempt directory, which
    /// is created on first use; returns its path.
    pub fn write_config<T: serde::Serialize>(&self, name: &str, config: &T) -> Result<String, String> {
        let file = format!("{name}-{}.json", self.attempt);
        let dir = self.config_dir.unwrap_or(self.attempt_dir);
        let path = dir.join(&file);
        let write = || {
            std::fs::create_dir_all(dir)?;
            std::fs::write(&path, serde_json::to_vec_pretty(config).expect("a config serializes"))
        };
        write().map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        Ok(self.attempt_dir.join(file).to_string_lossy().to_string())
    }

    /// The job's plan: its steps, run in the spec's directory.
    pub fn plan(&self, steps: Vec<Vec<String>>, native: bool) -> JobPlan {
        JobPlan { steps, env: BTreeMap::new(), cwd: self.spec_dir.to_path_buf(), output_created_by_stage: native }
    }

    /// `world` ranks of a workload module under torchrun, on this machine, with the topology
    /// in Kubeflow Trainer's `PET_*` variables as a TrainJob's pods get it.
    pub fn torchrun(&self, world: u64, module: &str, config: &str) -> Result<JobPlan, String> {
        let python = self.python()?;
        let port = free_port();
        let argv = vec![
            python,
            "-m".into(),
            "torch.distributed.run".into(),
            "--nnodes=1".into(),
            format!("--nproc-per-node={world}"),
            "--node-rank=0".into(),
            "--master-addr=127.0.0.1".into(),
            format!("--master-port={port}"),
            "-m".into(),
            module.into(),
            config.to_string(),
        ];
        let mut plan = self.plan(vec![argv], false);
        for (k, v) in [
            ("PET_NNODES", "1".to_string()),
            ("PET_NPROC_PER_NODE", world.to_string()),
            ("PET_NODE_RANK", "0".to_string()),
            ("PET_MASTER_ADDR", "127.0.0.1".to_string()),
            ("PET_MASTER_PORT", port.to_string()),
            ("OMP_NUM_THREADS", ((self.cpus / world as f64).floor() as usize).max(1).to_string()),
        ] {
            plan.env.insert(k.to_string(), v);
        }
        Ok(plan)
    }
}

/// What every Python stage's processes get besides mflow's own environment: the workloads
/// first on PYTHONPATH, then the user's own (a site of extra wheels, megatron-core from a
/// checkout, say). `mflow doctor` probes with exactly this, so that the two cannot drift.
pub fn python_env(env: &Environment) -> Result<BTreeMap<String, String>, crate::env::EnvError> {
    let mut path = env.workloads_dir()?.to_string_lossy().to_string();
    if let Some(user) = std::env::var_os("PYTHONPATH").filter(|p| !p.is_empty()) {
        path = format!("{path}:{}", user.to_string_lossy());
    }
    Ok(BTreeMap::from([("PYTHONPATH".to_string(), path), ("PYTHONUNBUFFERED".to_string(), "1".to_string())]))
}

/// Digest of the code a kind runs: the embedded workloads for Python kinds, mflow itself for
/// the native ones, nothing for `command` (its argv is a parameter).
pub fn workload_digest(kind: Kind) -> String {
    match kind {
        Kind::Command => String::new(),
        k if k.uses_python() => {
            format!("workloads:{} mflow:{}", crate::env::workloads_digest(), env!("CARGO_PKG_VERSION"))
        }
        _ => format!("mflow:{}", env!("CARGO_PKG_VERSION")),
    }
}

/// `s` when it names a path of its own, not an upstream output or a file in one.
pub(super) fn literal_path(s: &str) -> Option<String> {
    let is_ref =
        crate::spec::pieces(s).map_or(true, |p| p.iter().any(|p| matches!(p, crate::spec::Piece::StageOutput(_))));
    (!s.is_empty() && !is_ref).then(|| s.to_string())
}

/// A TCP port free right now on the loopback interface, for a stage's rendezvous.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(29500)
}
