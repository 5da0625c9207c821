//! The notebook of examples/notebooks, run headless by Papermill with the Kubernetes backend from
//! outside the cluster, as a notebook user with a kubeconfig runs it: the mflow wheel installed
//! in a notebook-like venv, every stage a TrainJob, the exported model downloaded and generating.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use mflow_e2e::{Case, RunStatus, StageStatus};
use mflow_kube::{LABEL_PIPELINE, LABEL_STAGE};
use serde_json::{json, Value};

use crate::train::{checkout, prepare_train_case};

/// A venv with the wheel, Papermill and the stage environment's torch and transformers
/// (scripts/notebook-venv), made once per cluster.
fn notebook_venv(c: &Case, wheel: &Path) -> PathBuf {
    let venv = c.suite.state.join("notebook-venv");
    if venv.join(".complete").exists() {
        return venv;
    }
    let python = c.mflow(["env"]).env("MFLOW_HOME", &c.suite.local_home).env_remove("MFLOW_PYTHON").run();
    let python = python.stdout.trim().to_string();
    let _ = std::fs::remove_dir_all(&venv);
    let status = Command::new("bash")
        .arg(c.suite.repo.join("scripts/notebook-venv"))
        .arg(&venv)
        .arg(wheel)
        .env("MFLOW_PYTHON", &python)
        .status()
        .expect("scripts/notebook-venv");
    assert!(status.success(), "scripts/notebook-venv {} {}", venv.display(), wheel.display());
    std::fs::write(venv.join(".complete"), "").expect("marking the venv complete");
    venv
}

/// The text a cell of an executed notebook printed.
fn cell_output(nb: &Value, id: &str) -> String {
    let cells = nb["cells"].as_array().expect("cells");
    let cell = cells.iter().find(|c| c["id"] == id).unwrap_or_else(|| panic!("no cell {id}"));
    let mut text = String::new();
    for out in cell["outputs"].as_array().into_iter().flatten() {
        let part = match out["output_type"].as_str() {
            Some("stream") => &out["text"],
            Some("execute_result" | "display_data") => &out["data"]["text/plain"],
            _ => continue,
        };
        match part {
            Value::String(s) => text.push_str(s),
            Value::Array(lines) => lines.iter().filter_map(Value::as_str).for_each(|l| text.push_str(l)),
            _ => {}
        }
    }
    text
}

/// examples/notebooks/mflow-pipeline.ipynb with `backend = "kubernetes"`: the main pipeline (its
/// own name, so nothing is shared with the main job's cases), 20 iterations with the gates of
/// the README's short walk, and this cluster's namespace, images and runtimes as `settings`.
pub fn notebook_on_kubelet(c: &Case) {
    let wheel = c.suite.wheel.clone().unwrap_or_else(|| {
        panic!("no mflow wheel: set MFLOW_E2E_WHEEL, or build one into target/wheels/ (scripts/release DIR)")
    });
    prepare_train_case(c);
    let venv = notebook_venv(c, &wheel);
    let notebooks = checkout(c).join("examples/notebooks");
    let _ = std::fs::remove_dir_all(c.outside_workdir());
    let s = &c.suite;
    let params = json!({
        "gates": {"val_ppl": "< 200", "val_loss_delta_vs_baseline": "< -1.0"},
        "settings": {
            "pipeline.name": c.pipeline(),
            "pipeline.kubernetes.namespace": s.namespace,
            "pipeline.kubernetes.image": s.cpu_image,
            "pipeline.kubernetes.train_image": s.train_image,
            "pipeline.kubernetes.runtime": s.torch_runtime,
            "pipeline.kubernetes.cpu_runtime": s.cpu_runtime,
            "pipeline.kubernetes.driver.host_network": true,
            "pipeline.kubernetes.driver.env.KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "pipeline.kubernetes.driver.env.KUBERNETES_SERVICE_PORT": "6443",
        },
    });
    let executed = s.state.join("notebook-out.ipynb");
    let t = Instant::now();
    c.mflow(["mflow-pipeline.ipynb"])
        .arg(&executed)
        .program(venv.join("bin/papermill"))
        .dir(&notebooks)
        .args(["--kernel", "python3", "--no-progress-bar", "-p", "backend", "kubernetes", "-p", "iterations", "20"])
        .arg("-p")
        .arg("mflow_wheel")
        .arg(&wheel)
        .args(["-y", &params.to_string()])
        .outside()
        .run();
    println!("the notebook ran in {}s", t.elapsed().as_secs());

    let nb: Value = serde_json::from_slice(&std::fs::read(&executed).expect("the executed notebook")).expect("JSON");
    let run = cell_output(&nb, "run");
    assert!(run.contains("run succeeded: 7 ran, 0 cached"), "the run cell printed:\n{run}");
    let gates = cell_output(&nb, "gates");
    assert!(gates.contains("-> pass") && !gates.contains("FAIL"), "the gates cell printed:\n{gates}");
    let model = cell_output(&nb, "model");
    assert!(model.contains("generated: 'fn main() {"), "the model cell printed:\n{model}");

    // The record on the volume, as mflow wrote it: every stage ran, train as torchrun ranks.
    let runs = Case::runs_in(&c.outside_workdir());
    let rec = c.outside_record(runs.last().expect("a run of the notebook"));
    assert_eq!(rec.status, RunStatus::Succeeded, "run status");
    crate::pipeline::all_stages(&rec, StageStatus::Succeeded);
    let jobs = c.cluster().trainjobs(&format!("{LABEL_PIPELINE}={},{LABEL_STAGE}=train", c.pipeline()));
    let job = jobs.first().expect("the train stage's TrainJob");
    assert_eq!(job.spec.runtime_ref.name, s.torch_runtime, "runtime of {}", job.name());
    assert!(job.condition("Complete"), "TrainJob {} Complete", job.name());
}
