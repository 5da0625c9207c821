//! The objects a run on Kubernetes would submit, without running it: printed as YAML with no
//! cluster at all (`mflow render SPEC --backend kubernetes`), or sent to the API server as a
//! server-side dry run (`mflow run --dry-run`).
//!
//! Each stage is shaped exactly as a run's first attempt would be (same commands,
//! environment, images, runtimes and names), with `<workdir>/runs/rendered` standing for the
//! run's directory. A stage whose upstream output is not computed yet has a provisional cache
//! key (and so TrainJob name): its key depends on that output's digest.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mflow_kube::{KubeBackend, StageRequest};
use serde_json::Value as Json;

use super::layout::Layout;
use super::{workload_files, KubernetesError};
use crate::backend::Job;
use crate::cache::Store;
use crate::env::Environment;
use crate::plan::Plan;
use crate::stages::{build_job, JobContext};

/// One stage's TrainJob as a run would submit it.
pub struct StageObject {
    pub stage: String,
    pub request: StageRequest,
    pub manifest: Json,
    /// Already in the cache: a run would not submit it.
    pub cached: bool,
    /// The upstream stage whose output is not computed yet, making the key provisional.
    pub provisional_on: Option<String>,
}

/// Everything a run of the plan would create in the cluster.
pub struct Objects {
    /// The workload ConfigMap, when a stage runs Python: (digest, object).
    pub workloads: Option<(String, Json)>,
    pub stages: Vec<StageObject>,
}

/// Shapes every stage of the plan. Reads the local cache to know which keys are final;
/// writes nothing but a temporary directory for the stages' config files.
pub fn objects(plan: &Plan, store: &Store) -> Result<Objects, KubernetesError> {
    let layout = Layout::of(plan)?;
    let opts = layout.options(&plan.spec)?;
    let run_dir = plan.spec.workdir().rendered();
    let scratch = std::env::temp_dir().join(format!("mflow-render-{}-{}", std::process::id(), fastrand::u64(..)));
    // Python programs are replaced by the image's `python`; no interpreter is needed here.
    let env = Environment::detect(Some("python3"));
    let result = shape_all(plan, store, &layout, &opts, &env, &run_dir, &scratch);
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

fn shape_all(
    plan: &Plan,
    store: &Store,
    layout: &Layout,
    opts: &mflow_kube::KubeOptions,
    env: &Environment,
    run_dir: &Path,
    scratch: &Path,
) -> Result<Objects, KubernetesError> {
    let n = plan.stages.len();
    let mut digests: Vec<Option<String>> = vec![None; n];
    let mut keys: Vec<String> = Vec::with_capacity(n);
    let mut pending: Vec<Option<String>> = vec![None; n];
    let mut stages = Vec::new();
    let mut uses_python = false;
    for (i, st) in plan.stages.iter().enumerate() {
        let name = st.spec.name.clone();
        // Upstream outputs not computed yet stand in with their own keys.
        let parts = plan
            .parts_with(i, &|d| digests[d].clone().or_else(|| Some(format!("pending:{}", keys[d]))))
            .expect("every upstream digest is known or stands in");
        let key = parts.key();
        let provisional_on = st.deps.iter().find_map(|&d| {
            if digests[d].is_none() {
                Some(plan.stages[d].spec.name.clone())
            } else {
                pending[d].clone()
            }
        });
        let cached = store.manifest(&key).filter(|m| m.key == key).map(|m| m.digest.clone());
        keys.push(key.clone());
        digests[i] = cached.clone();
        pending[i] = provisional_on.clone();

        let upstream: BTreeMap<String, PathBuf> =
            st.deps.iter().map(|&d| (plan.stages[d].spec.name.clone(), store.output_dir(&keys[d]))).collect();
        // The TrainJob writes to its own directory, as in a run.
        let area = layout.attempt_area(store.workdir(), &name, &key, 1);
        let out = area.out.clone();
        let stage_dir = crate::workdir::stage_dir(run_dir, &name);
        let config_dir = crate::workdir::stage_dir(scratch, &name);
        std::fs::create_dir_all(&config_dir)
            .map_err(|e| KubernetesError::Volume { path: config_dir.display().to_string(), message: e.to_string() })?;
        let info = &layout.stages[&name];
        let gpus: Vec<String> = (0..info.resources.gpus).map(|g| format!("cluster-{g}")).collect();
        let cx = JobContext {
            stage: &st.spec,
            engine: st.engine.as_ref(),
            output: &out,
            scratch: &plan.spec.workdir().scratch(&key),
            // Config files are written to a temporary directory and named where a run keeps them.
            attempt_dir: &stage_dir,
            config_dir: Some(&config_dir),
            attempt: 1,
            spec_dir: &plan.spec.dir,
            env,
            upstream: &upstream,
            gpus: &gpus,
            cpus: info.resources.cpus.max(1.0),
        };
        let job_plan = build_job(&cx).map_err(|message| KubernetesError::Render { stage: name.clone(), message })?;
        let job = Job {
            stage: name.clone(),
            key: key.clone(),
            attempt: 1,
            steps: job_plan.steps,
            env: job_env(job_plan.env, &st.spec.env, &out, &cx, &stage_dir, run_dir, &upstream),
            cwd: job_plan.cwd,
            timeout: st.spec.timeout,
            log: stage_dir.join("attempt-1.log"),
            status_file: stage_dir.join("attempt-1.status.json"),
            area,
        };
        let digest = info.kind.uses_python().then(crate::env::workloads_digest);
        uses_python |= digest.is_some();
        let request = layout.request(&job, info, digest)?;
        let manifest = mflow_kube::trainjob_manifest(&request, opts);
        stages.push(StageObject { stage: name, request, manifest, cached: cached.is_some(), provisional_on });
    }
    let workloads = if uses_python {
        let digest = crate::env::workloads_digest();
        let cm = mflow_kube::workloads_configmap(&digest, &workload_files())?;
        let mut cm = serde_json::to_value(cm).unwrap_or(Json::Null);
        cm["apiVersion"] = "v1".into();
        cm["kind"] = "ConfigMap".into();
        if let Some(ns) = &opts.namespace {
            cm["metadata"]["namespace"] = ns.clone().into();
        }
        Some((digest, cm))
    } else {
        None
    };
    Ok(Objects { workloads, stages })
}

/// The environment the engine gives an attempt (see the engine's stage runner).
fn job_env(
    mut env: BTreeMap<String, String>,
    stage_env: &BTreeMap<String, String>,
    out: &Path,
    cx: &JobContext<'_>,
    stage_dir: &Path,
    run_dir: &Path,
    upstream: &BTreeMap<String, PathBuf>,
) -> BTreeMap<String, String> {
    let d = |p: &Path| p.display().to_string();
    env.extend(stage_env.iter().map(|(k, v)| (k.clone(), v.clone())));
    env.insert("MFLOW_OUTPUT".into(), d(out));
    env.insert("MFLOW_SCRATCH".into(), d(cx.scratch));
    env.insert("MFLOW_PROGRESS".into(), d(&stage_dir.join("attempt-1.progress.jsonl")));
    env.insert("MFLOW_METRICS".into(), d(&stage_dir.join("metrics.jsonl")));
    env.insert("MFLOW_STATUS".into(), d(&stage_dir.join("attempt-1.status.json")));
    env.insert("MFLOW_ATTEMPT".into(), "1".into());
    env.insert("MFLOW_STAGE".into(), cx.stage.name.clone());
    env.insert("MFLOW_RUN_DIR".into(), d(run_dir));
    for (up, path) in upstream {
        env.insert(crate::spec::input_var(up), d(path));
    }
    env
}

/// Every object as a YAML stream, each TrainJob preceded by a comment on its stage.
pub fn render(plan: &Plan, store: &Store) -> Result<String, KubernetesError> {
    let objects = objects(plan, store)?;
    let mut out = String::new();
    let mut doc = |comment: String, value: &Json| {
        out.push_str("---\n");
        out.push_str(&comment);
        out.push_str(&serde_yaml::to_string(value).unwrap_or_default());
    };
    if let Some((digest, cm)) = &objects.workloads {
        doc(format!("# workload code {}\n", &digest[..16.min(digest.len())]), cm);
    }
    for s in &objects.stages {
        let mut comment = format!("# stage {}\n", s.stage);
        if s.cached {
            comment.push_str("# cached: a run would not submit this TrainJob\n");
        }
        if let Some(up) = &s.provisional_on {
            comment.push_str(&format!(
                "# provisional key and name: they depend on the output of `{up}`, not computed yet\n"
            ));
        }
        doc(comment, &s.manifest);
    }
    Ok(out)
}

/// What the server said of one object in a dry run.
pub struct DryRun {
    pub stage: String,
    pub name: String,
    pub result: Result<(), KubernetesError>,
}

/// Connects (with the preflight checks of a run) and sends every object a run would create
/// as a server-side dry run. Stages already cached are skipped, as a run would skip them.
pub async fn dry_run(plan: &Plan, store: &Store) -> Result<Vec<DryRun>, KubernetesError> {
    let layout = Layout::of(plan)?;
    let kube = KubeBackend::connect(layout.options(&plan.spec)?).await?;
    kube.preflight().await?;
    let objects = objects(plan, store)?;
    let mut results = Vec::new();
    if let Some((digest, cm)) = &objects.workloads {
        let name = cm["metadata"]["name"].as_str().unwrap_or_default().to_string();
        let result = kube.dry_run_workloads(digest, &workload_files()).await.map_err(KubernetesError::from);
        results.push(DryRun { stage: String::new(), name: format!("ConfigMap {name}"), result });
    }
    for s in objects.stages.iter().filter(|s| !s.cached) {
        let name = s.manifest["metadata"]["name"].as_str().unwrap_or_default().to_string();
        let result = kube.dry_run(&s.request).await.map_err(KubernetesError::from);
        results.push(DryRun { stage: s.stage.clone(), name: format!("TrainJob {name}"), result });
    }
    Ok(results)
}
