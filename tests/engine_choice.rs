//! `engine = "auto"` on machines with fewer GPUs than a stage's ranks: the reference engine is
//! chosen and said why (`mflow plan`, the line a run prints, the run record), an explicit
//! `megatron` that cannot run is refused at plan time, and the key names the engine that runs.
//! The GPUs are faked with CUDA_VISIBLE_DEVICES and with `MFLOW_NVIDIA_GPUS_DIR`, which stands
//! in for the driver's list (/proc/driver/nvidia/gpus); no GPU is needed.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{code, stderr, stdout, Project};
use serde_json::Value;

fn main_spec() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("specs/gpt-tp2.toml")
}

/// `mflow plan specs/gpt-tp2.toml` with a workdir and home of its own, and `gpus` faked: `cvd`
/// as CUDA_VISIBLE_DEVICES (None: unset), `driver` GPUs in the driver's list.
fn plan_main(cvd: Option<&str>, driver: usize, extra: &[&str]) -> Output {
    let tmp = tempfile::tempdir().unwrap();
    let list = tmp.path().join("driver-gpus");
    std::fs::create_dir(&list).unwrap();
    for i in 0..driver {
        std::fs::create_dir(list.join(format!("0000:{:02x}:00.0", i + 1))).unwrap();
    }
    let mut c = Command::new(env!("CARGO_BIN_EXE_mflow"));
    c.arg("plan").arg(main_spec()).arg("--set").arg(format!("pipeline.workdir={}", tmp.path().join("work").display()));
    c.args(extra)
        .env("MFLOW_HOME", tmp.path().join("home"))
        .env("MFLOW_NVIDIA_GPUS_DIR", &list)
        .env("CI", "true")
        .env_remove("CUDA_VISIBLE_DEVICES");
    if let Some(v) = cvd {
        c.env("CUDA_VISIBLE_DEVICES", v);
    }
    c.output().unwrap()
}

#[test]
fn one_gpu_plans_the_main_job_on_the_reference_engine_and_says_why() {
    // CUDA_VISIBLE_DEVICES=0 on a one-GPU machine, and the driver's list alone.
    for o in [plan_main(Some("0"), 1, &[]), plan_main(None, 1, &[])] {
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        let out = stdout(&o);
        assert!(
            out.lines().any(|l| l == "train: engine reference (auto: tp x pp x dp = 2 needs 2 GPUs, 1 visible)"),
            "{out}"
        );
        // Evaluation at tp = 1 fits the one GPU.
        assert!(out.lines().any(|l| l == "evaluate: engine megatron (auto: tp = 1 needs 1 GPU, 1 visible)"), "{out}");
        assert!(out.lines().any(|l| l.starts_with("export: engine reference (")), "{out}");
    }
    let o = plan_main(None, 2, &[]);
    assert!(
        stdout(&o).contains("train: engine megatron (auto: tp x pp x dp = 2 needs 2 GPUs, 2 visible)"),
        "{}",
        stdout(&o)
    );
    let o = plan_main(None, 0, &[]);
    assert!(stdout(&o).contains("train: engine reference (auto: no GPU visible)"), "{}", stdout(&o));
    // CUDA_VISIBLE_DEVICES narrows the driver's list.
    let o = plan_main(Some("1"), 2, &[]);
    assert!(
        stdout(&o).contains("train: engine reference (auto: tp x pp x dp = 2 needs 2 GPUs, 1 visible)"),
        "{}",
        stdout(&o)
    );

    // The JSON plan carries the same choice.
    let o = plan_main(Some("0"), 1, &["--format", "json"]);
    let plan: Value = serde_json::from_slice(&o.stdout).unwrap();
    let train = plan.as_array().unwrap().iter().find(|d| d["stage"] == "train").unwrap();
    assert_eq!(train["engine"]["name"], "reference", "{train}");
    assert_eq!(train["engine"]["reason"], "auto: tp x pp x dp = 2 needs 2 GPUs, 1 visible");
    let model = plan.as_array().unwrap().iter().find(|d| d["stage"] == "model").unwrap();
    assert!(model.get("engine").is_none(), "a native stage has no engine: {model}");
}

#[test]
fn an_explicit_megatron_on_too_few_gpus_is_refused_at_plan_time() {
    let o = plan_main(Some("0"), 1, &["--set", "stages.train.engine=\"megatron\""]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    // As one line: the report wraps long messages behind a margin.
    let err = stderr(&o).replace('│', " ").split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        err.contains("stage `train`: engine = \"megatron\" needs 2 GPUs (tp x pp x dp = 2, one per rank), 1 visible"),
        "{err}"
    );
    assert!(err.contains("lower tp/pp/dp until tp x pp x dp is at most 1"), "{err}");
    assert!(err.contains("set engine = \"auto\" or \"reference\""), "{err}");
    // Without any GPU, the same.
    let o = plan_main(None, 0, &["--set", "stages.train.engine=\"megatron\""]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("no GPU is visible"), "{}", stderr(&o));
    // On enough GPUs it plans, and says it was asked for.
    let o = plan_main(Some("0,1"), 2, &["--set", "stages.train.engine=\"megatron\""]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).contains("train: engine megatron (set in the spec)"), "{}", stdout(&o));
}

/// The engine that runs is in the key: a Megatron result is never taken for a reference run,
/// nor the other way round. The count of GPUs behind the choice is not.
#[test]
fn the_key_follows_the_engine_not_the_gpu_count() {
    let path = main_spec();
    let work = tempfile::tempdir().unwrap();
    let key_with = |gpus: usize| {
        let sets = vec![format!("pipeline.workdir={}", work.path().display())];
        let spec = mflow::spec::parse(&path, &std::fs::read_to_string(&path).unwrap(), &sets).unwrap();
        let env = mflow::env::Environment::detect(None).with_gpus((0..gpus).map(|i| i.to_string()).collect());
        let plan = mflow::plan::build(spec, &env).unwrap();
        let i = plan.index("train").unwrap();
        let parts = plan.parts_with(i, &|_| Some("upstream".into())).unwrap();
        (plan.key(i, &parts), parts.params["engine"].clone(), plan.stages[i].engine.clone().unwrap())
    };
    let (none, one, two) = (key_with(0), key_with(1), key_with(2));
    assert_eq!((one.1.as_str(), two.1.as_str()), (Some("reference"), Some("megatron")));
    assert_ne!(one.0, two.0, "the reference and the Megatron result have different keys");
    assert_eq!(none.0, one.0, "a reference result is the same with 0 or 1 GPU visible");
    assert_ne!(none.2.reason, one.2.reason, "the reason differs, the key does not");
}

/// Locally a stage that requests GPUs gets exactly those (the pool hands them out), so they are
/// what the choice counts, not the machine's.
#[test]
fn requested_gpus_are_what_the_choice_counts() {
    let dir = tempfile::tempdir().unwrap();
    let spec = format!("{}\n[stages.train.resources]\ngpus = 1\n", TRAIN);
    let path = dir.path().join("spec.toml");
    std::fs::write(&path, &spec).unwrap();
    inputs_of_train(dir.path());
    let spec = mflow::spec::parse(&path, &spec, &[]).unwrap();
    let env = mflow::env::Environment::detect(None).with_gpus(vec!["0".into(), "1".into()]);
    let plan = mflow::plan::build(spec, &env).unwrap();
    let engine = plan.stages[plan.index("train").unwrap()].engine.clone().unwrap();
    assert_eq!(engine.to_string(), "engine reference (auto: tp x pp x dp = 2 needs 2 GPUs, 1 visible)");
}

/// A stand-in interpreter: as torchrun it writes the environment it got into the stage's output
/// (and succeeds); as doctor's probe it writes it to $DUMP/doctor.env and prints a report.
const FAKE_PYTHON: &str = r#"#!/bin/sh
if [ -n "$MFLOW_OUTPUT" ]; then mkdir -p "$MFLOW_OUTPUT"; env > "$MFLOW_OUTPUT/env.txt"; exit 0; fi
env > "$DUMP/doctor.env"
echo '{"python": "fake", "cuda_devices": []}'
"#;

fn fake_python(p: &Project) -> PathBuf {
    let py = p.file("python");
    std::fs::write(&py, FAKE_PYTHON).unwrap();
    std::fs::set_permissions(&py, std::fs::Permissions::from_mode(0o755)).unwrap();
    py
}

fn var<'a>(env: &'a str, name: &str) -> Option<&'a str> {
    env.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix('='))
}

const TRAIN: &str = r#"
[pipeline]
name = "engines"

[stages.train]
kind = "train"
model = "shards"
data = "data"
tp = 2
iterations = 1
"#;

/// The shards and dataset directories TRAIN names: a stage's path parameters are read, and
/// hashed into its key, at plan time.
fn inputs_of_train(dir: &Path) {
    for d in ["shards", "data"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
        std::fs::write(dir.join(d).join("stand-in"), d).unwrap();
    }
}

/// A run on one GPU prints the choice when the stage starts, records it, and runs the
/// reference engine's ranks with the GPU hidden (gloo on CPU). Doctor's probe then gets the
/// same PYTHONPATH as that stage.
#[test]
fn a_run_records_the_engine_and_doctor_sees_the_stages_environment() {
    let p = Project::new(TRAIN);
    inputs_of_train(p.path());
    let py = fake_python(&p);
    let site = p.file("site");
    let with = |c: &mut Command| {
        c.env("MFLOW_PYTHON", &py)
            .env("MFLOW_HOME", p.file("home"))
            .env("CUDA_VISIBLE_DEVICES", "0")
            .env("PYTHONPATH", &site)
            .env("DUMP", p.path());
    };
    let mut c = p.cmd(&["run", "spec.toml"]);
    with(&mut c);
    let o = c.output().unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("▶ train started: engine reference (auto: tp x pp x dp = 2 needs 2 GPUs, 1 visible)"),
        "{}",
        stderr(&o)
    );
    let r = p.latest_record();
    assert_eq!(r["stages"]["train"]["engine"]["name"], "reference", "{}", r["stages"]["train"]);
    assert_eq!(r["stages"]["train"]["engine"]["reason"], "auto: tp x pp x dp = 2 needs 2 GPUs, 1 visible");
    let stage_env =
        std::fs::read_to_string(Path::new(r["stages"]["train"]["output"].as_str().unwrap()).join("env.txt")).unwrap();
    assert_eq!(var(&stage_env, "CUDA_VISIBLE_DEVICES"), Some(""), "the reference engine's ranks run on CPU");
    assert_eq!(var(&stage_env, "PET_NPROC_PER_NODE"), Some("2"));

    let mut c = p.cmd(&["doctor"]);
    with(&mut c);
    let o = c.output().unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let doctor_env = std::fs::read_to_string(p.file("doctor.env")).unwrap();
    let path = var(&stage_env, "PYTHONPATH").unwrap();
    assert!(
        path.ends_with(&format!(":{}", site.display())),
        "the user's PYTHONPATH stays, after the workloads: {path}"
    );
    for name in ["PYTHONPATH", "PYTHONUNBUFFERED"] {
        assert_eq!(var(&doctor_env, name), var(&stage_env, name), "{name}");
    }
    assert!(stdout(&o).contains(&format!("PYTHONPATH (as the stages get it): {path}")), "{}", stdout(&o));
}
