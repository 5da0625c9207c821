//! From a planned stage to the commands that produce its output.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value as Json};

use super::Kind;
use crate::env::Environment;
use crate::spec::StageSpec;

/// The engine a train or evaluate stage (or an export's verification) runs with, and why, in
/// words: `mflow plan` shows it, a run prints it when the stage starts and keeps it in the
/// stage's record. Only `name` enters the cache key (as the `engine` parameter): the reason
/// counts this machine's GPUs, and a reference result made with 0 or 1 GPU visible is the same.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EngineChoice {
    pub name: String,
    pub reason: String,
}

impl std::fmt::Display for EngineChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "engine {} ({})", self.name, self.reason)
    }
}

/// Parameters as they enter the cache key: defaults filled, `auto` choices made; and the engine
/// chosen, for the kinds that have one.
/// `gpus`: GPUs the stage's processes will see (`crate::backend::stage_gpus`).
pub fn resolve_params(st: &StageSpec, gpus: usize) -> Result<(Json, Option<EngineChoice>), (String, String)> {
    let mut p = st.params.clone();
    if !st.env.is_empty() {
        // Environment variables shape the output as much as parameters do.
        p.insert("env".into(), json!(st.env));
    }
    let mut choice = None;
    if matches!(st.kind, Kind::Train | Kind::Evaluate) {
        let chosen = choose_engine(st.kind, &p, gpus)?;
        if st.kind == Kind::Train && p.get("precision").and_then(Json::as_str) == Some("auto") {
            p.insert("precision".into(), json!(if chosen.name == "megatron" { "bf16" } else { "fp32" }));
        }
        // The engine that runs is part of the key, so that a Megatron result is never reused
        // for a reference run or the other way round.
        p.insert("engine".into(), json!(chosen.name));
        choice = Some(chosen);
    } else if st.kind == Kind::Export && p.get("verify").and_then(Json::as_bool).unwrap_or(true) {
        // verify_export merges every rank in memory and runs the reference model in one
        // process on CPU: no layout needs a GPU, so there is nothing to choose.
        choice = Some(EngineChoice { name: "reference".into(), reason: "the verification runs in one process on CPU, for any tp x pp".into() });
    }
    Ok((Json::Object(p), choice))
}

/// `engine = "auto"` runs Megatron-Core when the GPUs the stage will see cover its ranks (one
/// GPU per rank, NCCL), else the reference engine, which runs any layout as gloo ranks on CPU
/// (a stage that requests no GPUs gets none: `build_job`). An explicit `megatron` that cannot
/// run is an error at plan time rather than a crash in NCCL later.
pub fn choose_engine(kind: Kind, p: &Map<String, Json>, gpus: usize) -> Result<EngineChoice, (String, String)> {
    let world = world_size(kind, p) as usize;
    let sizes = if kind == Kind::Train { "tp x pp x dp" } else { "tp" };
    let of = |n: usize| if n == 1 { "1 GPU".to_string() } else { format!("{n} GPUs") };
    let pick = |name: &str, reason: String| Ok(EngineChoice { name: name.into(), reason });
    match p.get("engine").and_then(Json::as_str).unwrap_or("auto") {
        "auto" if gpus == 0 => pick("reference", "auto: no GPU visible".into()),
        "auto" if world > gpus => pick("reference", format!("auto: {sizes} = {world} needs {}, {gpus} visible", of(world))),
        "auto" => pick("megatron", format!("auto: {sizes} = {world} needs {}, {gpus} visible", of(world))),
        "megatron" if gpus == 0 => Err((
            "engine = \"megatron\" needs CUDA, and no GPU is visible".into(),
            "run on a machine with GPUs, or set engine = \"reference\" (or \"auto\") to train on CPU".into(),
        )),
        "megatron" if world > gpus => Err((
            format!("engine = \"megatron\" needs {} ({sizes} = {world}, one per rank), {gpus} visible", of(world)),
            format!("lower {} until {sizes} is at most {gpus}, make more GPUs visible (resources.gpus x nodes on Kubernetes), or set engine = \"auto\" or \"reference\": the reference engine runs any layout on CPU", sizes.replace(" x ", "/")),
        )),
        other => pick(other, "set in the spec".into()),
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

/// Files outside the DAG that a kind reads, relative to the spec (`spec_dir`), as input
/// patterns: every parameter that names a path rather than an upstream output (whose digest
/// is in the key already). They enter the key and are held to the project as `inputs` are.
pub fn external_inputs(st: &StageSpec, spec_dir: &Path) -> Vec<String> {
    // A value holding `${stages.X.output}` is an upstream output, or a file in one.
    let path = |key: &str| st.params.get(key).and_then(Json::as_str).filter(|s| !s.is_empty() && !has_stage_ref(s)).map(str::to_string);
    let mut out = Vec::new();
    match st.kind {
        Kind::Command => {}
        Kind::Model => out.extend(path("source").and_then(|s| s.strip_prefix("path:").map(str::to_string))),
        Kind::Dataset => out.extend(path("tokenizer").filter(|t| t != "byte-level").map(|t| tokenizer_files(&t, spec_dir)).unwrap_or_default()),
        Kind::Convert | Kind::Export => out.extend(path("model")),
        Kind::Train | Kind::Evaluate => out.extend(["model", "data"].into_iter().filter_map(path)),
    }
    // Literal paths: a `[` or `*` in a file name is not a pattern.
    out.iter().map(|p| glob::Pattern::escape(p)).collect()
}

fn has_stage_ref(s: &str) -> bool {
    crate::spec::pieces(s).map_or(true, |p| p.iter().any(|p| matches!(p, crate::spec::Piece::StageOutput(_))))
}

/// Files beside a tokenizer that decide what it does: `tokenizer_config.json` names the
/// end-of-document token, `special_tokens_map.json` the special tokens.
const TOKENIZER_COMPANIONS: [&str; 2] = ["tokenizer_config.json", "special_tokens_map.json"];

/// The files a tokenizer given as a path is read from: tokenizer.json (the path itself, or in
/// the directory it names) and the companions beside it that exist.
fn tokenizer_files(tok: &str, spec_dir: &Path) -> Vec<String> {
    let dir_named = std::fs::metadata(spec_dir.join(tok)).is_ok_and(|m| m.is_dir());
    let (dir, main) = if dir_named {
        (Path::new(tok).to_path_buf(), Path::new(tok).join("tokenizer.json"))
    } else {
        (Path::new(tok).parent().map(Path::to_path_buf).unwrap_or_default(), PathBuf::from(tok))
    };
    let mut files = vec![main.to_string_lossy().to_string()];
    for name in TOKENIZER_COMPANIONS {
        let f = dir.join(name);
        if std::fs::symlink_metadata(spec_dir.join(&f)).is_ok() {
            files.push(f.to_string_lossy().to_string());
        }
    }
    files
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
    let exe = crate::env::mflow_exe().map_err(|e| format!("cannot locate the mflow binary: {e}"))?;
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
        env.extend(python_env(cx.env).map_err(|e| e.to_string())?);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn params(v: Json) -> Map<String, Json> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn auto_runs_megatron_only_where_every_rank_has_a_gpu() {
        let tp2 = params(json!({"engine": "auto", "tp": 2}));
        let on = |gpus| choose_engine(Kind::Train, &tp2, gpus).unwrap();
        assert_eq!(on(0), EngineChoice { name: "reference".into(), reason: "auto: no GPU visible".into() });
        // The one-GPU workstation: the reference engine runs the two ranks on CPU.
        assert_eq!(on(1).to_string(), "engine reference (auto: tp x pp x dp = 2 needs 2 GPUs, 1 visible)");
        assert_eq!(on(2).to_string(), "engine megatron (auto: tp x pp x dp = 2 needs 2 GPUs, 2 visible)");
        assert_eq!(on(8).name, "megatron");
        // pp and dp count as much as tp; a missing `engine` is `auto`.
        let big = params(json!({"tp": 2, "pp": 2, "dp": 2}));
        assert_eq!(choose_engine(Kind::Train, &big, 4).unwrap().reason, "auto: tp x pp x dp = 8 needs 8 GPUs, 4 visible");
        // Evaluation runs tp ranks.
        let eval = params(json!({"tp": 1}));
        assert_eq!(choose_engine(Kind::Evaluate, &eval, 1).unwrap().to_string(), "engine megatron (auto: tp = 1 needs 1 GPU, 1 visible)");
        assert_eq!(choose_engine(Kind::Evaluate, &params(json!({"tp": 2})), 1).unwrap().name, "reference");
    }

    #[test]
    fn an_explicit_engine_is_kept_or_refused_with_what_to_do() {
        let megatron = params(json!({"engine": "megatron", "tp": 2}));
        assert_eq!(choose_engine(Kind::Train, &megatron, 2).unwrap(), EngineChoice { name: "megatron".into(), reason: "set in the spec".into() });
        let (message, help) = choose_engine(Kind::Train, &megatron, 1).unwrap_err();
        assert_eq!(message, "engine = \"megatron\" needs 2 GPUs (tp x pp x dp = 2, one per rank), 1 visible");
        assert!(help.contains("lower tp/pp/dp") && help.contains("engine = \"auto\" or \"reference\""), "{help}");
        assert!(choose_engine(Kind::Train, &megatron, 0).unwrap_err().0.contains("no GPU is visible"));
        let reference = params(json!({"engine": "reference", "tp": 2}));
        assert_eq!(choose_engine(Kind::Train, &reference, 8).unwrap().name, "reference");
    }

    fn stage(kind: Kind, p: Json) -> StageSpec {
        StageSpec {
            name: "s".into(),
            kind,
            params: params(p),
            needs: vec![],
            inputs: vec![],
            retries: Default::default(),
            timeout: None,
            resources: crate::spec::Resources { gpus: 0, cpus: 1.0, cpus_given: false, memory: None },
            env: BTreeMap::new(),
            cache: true,
            salt: String::new(),
            gates: BTreeMap::new(),
            nodes: 1,
            image: None,
            description: None,
        }
    }

    /// The key covers the engine that runs, and only that: not the count of GPUs behind the
    /// choice.
    #[test]
    fn the_key_parameters_name_the_engine_that_runs() {
        let train = stage(Kind::Train, json!({"engine": "auto", "tp": 2, "precision": "auto"}));
        let on = |gpus| resolve_params(&train, gpus).unwrap();
        let ((none, _), (one, why), (two, _)) = (on(0), on(1), on(2));
        assert_eq!((one["engine"].as_str(), one["precision"].as_str()), (Some("reference"), Some("fp32")));
        assert_eq!((two["engine"].as_str(), two["precision"].as_str()), (Some("megatron"), Some("bf16")));
        assert_eq!(none, one, "a reference result is the same whatever GPUs were visible");
        assert_ne!(one, two);
        assert!(why.unwrap().reason.contains("1 visible"));
        let export = stage(Kind::Export, json!({"verify": true}));
        assert_eq!(resolve_params(&export, 0).unwrap().1.unwrap().name, "reference");
        assert_eq!(resolve_params(&stage(Kind::Export, json!({"verify": false})), 0).unwrap().1, None);
        assert_eq!(resolve_params(&stage(Kind::Convert, json!({"tp": 2})), 0).unwrap().1, None);
    }
}
