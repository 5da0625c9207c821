//! From a planned stage to the commands that produce its output.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value as Json};

use super::Kind;
use crate::env::Environment;
use crate::spec::StageSpec;

/// Parameters as they enter the cache key: defaults filled, `auto` choices made.
/// `gpus`: GPUs the stage's processes will see (`crate::backend::stage_gpus`).
pub fn resolve_params(st: &StageSpec, gpus: usize) -> Result<Json, (String, String)> {
    let mut p = st.params.clone();
    if !st.env.is_empty() {
        // Environment variables shape the output as much as parameters do.
        p.insert("env".into(), json!(st.env));
    }
    if matches!(st.kind, Kind::Train | Kind::Evaluate) {
        let engine = match p.get("engine").and_then(Json::as_str).unwrap_or("auto") {
            "auto" if gpus == 0 => "reference",
            "auto" => "megatron",
            "megatron" if gpus == 0 => {
                return Err((
                    "engine = \"megatron\" needs CUDA, and no GPU is visible".into(),
                    "run on a machine with GPUs, or set engine = \"reference\" (or \"auto\") to train on CPU".into(),
                ))
            }
            other => other,
        }
        .to_string();
        if st.kind == Kind::Train && p.get("precision").and_then(Json::as_str) == Some("auto") {
            p.insert("precision".into(), json!(if engine == "megatron" { "bf16" } else { "fp32" }));
        }
        if engine == "megatron" {
            let world = world_size(st.kind, &p) as usize;
            if world > gpus {
                return Err((format!("needs {world} GPUs (tp x pp x dp), {gpus} visible"), "lower tp/pp/dp, or request more GPUs (resources.gpus x nodes on Kubernetes)".into()));
            }
        }
        p.insert("engine".into(), json!(engine));
    }
    Ok(Json::Object(p))
}

/// Files outside the DAG that a kind reads, relative to the spec.
pub fn external_inputs(st: &StageSpec) -> Vec<String> {
    match st.kind {
        Kind::Model => st.params.get("source").and_then(Json::as_str).and_then(|s| s.strip_prefix("path:")).map(|d| vec![d.to_string()]).unwrap_or_default(),
        _ => Vec::new(),
    }
}

/// Digest of the code a kind runs: the embedded workloads for Python kinds, mflow itself for
/// the native ones, nothing for `command` (its argv is a parameter).
pub fn workload_digest(kind: Kind) -> String {
    match kind {
        Kind::Command => String::new(),
        k if k.uses_python() => format!("workloads:{} mflow:{}", crate::env::workloads_digest(), env!("CARGO_PKG_VERSION")),
        _ => format!("mflow:{}", env!("CARGO_PKG_VERSION")),
    }
}

pub fn world_size(kind: Kind, p: &Map<String, Json>) -> u64 {
    let g = |k: &str| p.get(k).and_then(Json::as_u64).unwrap_or(1);
    match kind {
        Kind::Train => g("tp") * g("pp") * g("dp"),
        Kind::Evaluate => g("tp"),
        _ => 1,
    }
}

pub struct JobContext<'a> {
    pub stage: &'a StageSpec,
    /// Resolved parameters with `${stages.X.output}` replaced by paths.
    pub params: &'a Json,
    pub output: &'a Path,
    pub scratch: &'a Path,
    pub attempt_dir: &'a Path,
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

pub fn build_job(cx: &JobContext<'_>) -> Result<JobPlan, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot locate the mflow binary: {e}"))?;
    let exe = exe.to_string_lossy().to_string();
    let p = cx.params;
    let s = |k: &str| p.get(k).and_then(Json::as_str).unwrap_or_default().to_string();
    let n = |k: &str| p.get(k).map(|v| v.to_string()).unwrap_or_default();
    let out = cx.output.to_string_lossy().to_string();
    let abs = |x: String| -> String {
        let path = Path::new(&x);
        if path.is_absolute() { x } else { cx.spec_dir.join(path).to_string_lossy().to_string() }
    };
    let mut env = BTreeMap::new();
    let mut native = true;
    let steps = match cx.stage.kind {
        Kind::Command => {
            native = false;
            let argv: Vec<String> = p.get("run").and_then(Json::as_array).map(|a| a.iter().filter_map(Json::as_str).map(str::to_string).collect()).unwrap_or_default();
            vec![argv]
        }
        Kind::Model => {
            let src = s("source");
            let src = match src.strip_prefix("path:") {
                Some(d) => format!("path:{}", abs(d.to_string())),
                None => src,
            };
            vec![vec![exe.clone(), "model".into(), src, out.clone(), "--seed".into(), n("seed")]]
        }
        Kind::Convert => {
            let mut argv = vec![exe.clone(), "convert".into(), s("model"), out.clone(), "--tp".into(), n("tp"), "--pp".into(), n("pp")];
            if s("dtype") != "keep" {
                argv.extend(["--dtype".into(), s("dtype")]);
            }
            vec![argv]
        }
        Kind::Dataset => {
            let mut argv = vec![exe.clone(), "dataset".into()];
            for i in &cx.stage.inputs {
                argv.push(abs(i.clone()));
            }
            let tok = s("tokenizer");
            let tok = if tok == "byte-level" { tok } else { abs(tok) };
            argv.extend(["--tokenizer".into(), tok, "--out".into(), out.clone()]);
            for (flag, key) in [("--format", "format"), ("--split-by", "split_by"), ("--text-key", "text_key"), ("--splits", "splits"), ("--dtype", "dtype"), ("--on-invalid-utf8", "on_invalid_utf8"), ("--eod", "eod")] {
                if let Some(v) = p.get(key).and_then(Json::as_str) {
                    argv.extend([flag.to_string(), v.to_string()]);
                }
            }
            for (flag, key) in [("--seed", "seed"), ("--max-doc-tokens", "max_doc_tokens")] {
                if let Some(v) = p.get(key).and_then(Json::as_i64) {
                    argv.extend([flag.to_string(), v.to_string()]);
                }
            }
            argv.extend(["--threads".into(), (cx.cpus.round() as usize).max(1).to_string()]);
            vec![argv]
        }
        Kind::Train | Kind::Evaluate => {
            native = false;
            let module = if cx.stage.kind == Kind::Train { "mflow_workloads.train" } else { "mflow_workloads.evaluate" };
            let mut config = p.clone();
            config["stage"] = json!(cx.stage.kind.name());
            config["shards"] = json!(s("model"));
            config["data"] = json!(s("data"));
            config["output"] = json!(out);
            config["scratch"] = json!(cx.scratch);
            if let Some(obj) = config.as_object_mut() {
                obj.remove("model");
            }
            if cx.stage.kind == Kind::Evaluate {
                config["pp"] = json!(1);
                config["baseline"] = match p.get("baseline").and_then(Json::as_str) {
                    Some(b) => json!(cx.upstream.get(b).ok_or(format!("baseline stage `{b}` has no output"))?),
                    None => Json::Null,
                };
            }
            let world = world_size(cx.stage.kind, p.as_object().ok_or("parameters are not a table")?);
            let cfg_path = cx.attempt_dir.join(format!("{}-config-{}.json", cx.stage.kind.name(), cx.attempt));
            write_config(&cfg_path, &config)?;
            let python = cx.env.python().map_err(|e| e.to_string())?.to_string_lossy().to_string();
            let port = free_port();
            env.insert("PET_NNODES".into(), "1".into());
            env.insert("PET_NPROC_PER_NODE".into(), world.to_string());
            env.insert("PET_NODE_RANK".into(), "0".into());
            env.insert("PET_MASTER_ADDR".into(), "127.0.0.1".into());
            env.insert("PET_MASTER_PORT".into(), port.to_string());
            env.insert("OMP_NUM_THREADS".into(), ((cx.cpus / world as f64).floor() as usize).max(1).to_string());
            vec![torchrun(&python, world, port, module, &cfg_path)]
        }
        Kind::Export => {
            let mut steps = vec![vec![exe.clone(), "export".into(), s("model"), out.clone()]];
            if p.get("verify").and_then(Json::as_bool).unwrap_or(true) {
                let config = json!({
                    "stage": "verify_export", "hf": out, "shards": s("model"),
                    "prompts": p.get("prompts").cloned().unwrap_or(json!([])),
                    "max_new_tokens": p.get("max_new_tokens").cloned().unwrap_or(json!(16)),
                    "output": out,
                });
                let cfg_path = cx.attempt_dir.join(format!("verify-config-{}.json", cx.attempt));
                write_config(&cfg_path, &config)?;
                let python = cx.env.python().map_err(|e| e.to_string())?.to_string_lossy().to_string();
                steps.push(vec![python, "-m".into(), "mflow_workloads.verify_export".into(), cfg_path.to_string_lossy().to_string()]);
            }
            steps
        }
    };
    if cx.stage.kind.uses_python() {
        let dir = cx.env.workloads_dir().map_err(|e| e.to_string())?;
        // The workloads first; the user's own PYTHONPATH (a site of extra wheels, say) stays.
        let mut path = dir.to_string_lossy().to_string();
        if let Some(user) = std::env::var_os("PYTHONPATH").filter(|p| !p.is_empty()) {
            path = format!("{path}:{}", user.to_string_lossy());
        }
        env.insert("PYTHONPATH".into(), path);
        env.insert("PYTHONUNBUFFERED".into(), "1".into());
    }
    if !cx.gpus.is_empty() {
        env.insert("CUDA_VISIBLE_DEVICES".into(), cx.gpus.join(","));
    } else if matches!(cx.stage.kind, Kind::Train | Kind::Evaluate) && p.get("engine").and_then(Json::as_str) == Some("reference") {
        env.insert("CUDA_VISIBLE_DEVICES".into(), String::new());
    }
    Ok(JobPlan { steps, env, cwd: cx.spec_dir.to_path_buf(), output_created_by_stage: native })
}

/// Writes a workload's config into the attempt directory, which is created on first use.
fn write_config(path: &Path, config: &Json) -> Result<(), String> {
    let write = || {
        std::fs::create_dir_all(path.parent().unwrap_or(Path::new(".")))?;
        std::fs::write(path, serde_json::to_vec_pretty(config).expect("JSON serializes"))
    };
    write().map_err(|e| format!("cannot write {}: {e}", path.display()))
}

fn torchrun(python: &str, world: u64, port: u16, module: &str, config: &Path) -> Vec<String> {
    vec![
        python.to_string(),
        "-m".into(),
        "torch.distributed.run".into(),
        "--nnodes=1".into(),
        format!("--nproc-per-node={world}"),
        "--node-rank=0".into(),
        "--master-addr=127.0.0.1".into(),
        format!("--master-port={port}"),
        "-m".into(),
        module.into(),
        config.to_string_lossy().to_string(),
    ]
}

/// A TCP port free right now on the loopback interface, for a stage's rendezvous.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(29500)
}
