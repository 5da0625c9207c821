//! The TrainJob of one stage attempt, built as plain JSON so it can be checked against the CRD.

use serde_json::{json, Map, Value};

use crate::expansion::escape;
use crate::names::{key_prefix, label_value, trainjob_name};
use crate::{KubeError, KubeOptions, StageRequest};

pub const TRAINER_GROUP: &str = "trainer.kubeflow.org";
pub const TRAINER_VERSION: &str = "v1alpha1";
/// `runtimePatches[].manager` of mflow's patch (a domain-prefixed path, as Trainer requires).
pub const PATCH_MANAGER: &str = "mflow.dev/engine";

/// Where the artifact claim is mounted in every stage container.
pub const ARTIFACT_MOUNT: &str = "/mflow";
/// Where the workload ConfigMap is mounted.
pub const WORKLOADS_ROOT: &str = "/opt/mflow/workloads";
/// The ConfigMap key holding the workload tree as a zip archive. ConfigMap keys cannot name
/// directories, so the package (with its subpackages) travels zipped and Python imports it
/// straight from the archive (zipimport) once it is on `PYTHONPATH`.
pub const WORKLOADS_ZIP: &str = "mflow_workloads.zip";

pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY: &str = "mflow";
pub const LABEL_COMPONENT: &str = "mflow.dev/component";
pub const LABEL_PIPELINE: &str = "mflow.dev/pipeline";
pub const LABEL_STAGE: &str = "mflow.dev/stage";
pub const LABEL_STAGE_KIND: &str = "mflow.dev/stage-kind";
/// The first 32 characters of the cache key (label values stop at 63 characters).
pub const LABEL_KEY: &str = "mflow.dev/key";
pub const LABEL_ATTEMPT: &str = "mflow.dev/attempt";
/// Full, unshortened values live in annotations; ownership checks compare these.
pub const ANN_PIPELINE: &str = "mflow.dev/pipeline-name";
pub const ANN_STAGE: &str = "mflow.dev/stage-name";
pub const ANN_KEY: &str = "mflow.dev/cache-key";

/// Pod labels JobSet sets, used to find a TrainJob's trainer pods and their ranks.
pub const POD_JOBSET_LABEL: &str = "jobset.sigs.k8s.io/jobset-name";
pub const POD_REPLICATED_JOB_LABEL: &str = "jobset.sigs.k8s.io/replicatedjob-name";
pub const POD_RANK_LABEL: &str = "batch.kubernetes.io/job-completion-index";
/// Name of the trainer replicatedJob and of its container in Trainer's torch runtimes.
pub const NODE: &str = "node";

/// Environment variables Trainer injects and rejects when a TrainJob sets them.
pub const RESERVED_ENV: [&str; 5] =
    ["PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"];

/// Labels identifying the objects of one stage attempt.
pub fn stage_labels(req: &StageRequest) -> Map<String, Value> {
    let mut labels = Map::new();
    labels.insert(LABEL_MANAGED_BY.into(), MANAGED_BY.into());
    labels.insert(LABEL_COMPONENT.into(), "stage".into());
    labels.insert(LABEL_PIPELINE.into(), label_value(&req.pipeline).into());
    labels.insert(LABEL_STAGE.into(), label_value(&req.stage).into());
    labels.insert(LABEL_STAGE_KIND.into(), label_value(&req.kind).into());
    labels.insert(LABEL_KEY.into(), key_prefix(&req.key, 32).into());
    labels.insert(LABEL_ATTEMPT.into(), req.attempt.to_string().into());
    labels
}

fn stage_annotations(req: &StageRequest) -> Map<String, Value> {
    let mut ann = Map::new();
    ann.insert(ANN_PIPELINE.into(), req.pipeline.clone().into());
    ann.insert(ANN_STAGE.into(), req.stage.clone().into());
    ann.insert(ANN_KEY.into(), req.key.clone().into());
    ann
}

/// Name of the content-named ConfigMap that carries workload code with this digest.
pub fn workloads_configmap_name(digest: &str) -> String {
    format!("mflow-workloads-{}", key_prefix(digest, 16))
}

/// Checks what the API server or Trainer would reject, before anything is submitted.
pub fn validate_request(req: &StageRequest) -> Result<(), KubeError> {
    let bad = |field: &str, problem: &str| KubeError::BadRequest {
        stage: req.stage.clone(),
        field: field.to_string(),
        problem: problem.to_string(),
    };
    if let Some(name) = req.env.keys().find(|k| RESERVED_ENV.contains(&k.as_str())) {
        return Err(KubeError::ReservedEnv { stage: req.stage.clone(), name: name.clone() });
    }
    if req.image.trim().is_empty() {
        return Err(bad("image", "is empty"));
    }
    if req.command.is_empty() || req.command[0].is_empty() {
        return Err(bad("command", "is empty"));
    }
    if req.command.len() > 128 {
        return Err(bad("command", "has more than 128 items (Trainer's limit)"));
    }
    if req.env.len() > 120 {
        return Err(bad("env", "has more than 120 variables (Trainer allows 128, mflow adds its own)"));
    }
    if req.num_nodes == 0 {
        return Err(bad("num_nodes", "must be at least 1"));
    }
    if req.nproc_per_node == 0 {
        return Err(bad("nproc_per_node", "must be at least 1"));
    }
    if req.gpus_per_node > 0 && req.nproc_per_node > req.gpus_per_node {
        return Err(bad("nproc_per_node", "exceeds gpus_per_node: each GPU process needs its own GPU"));
    }
    if req.runtime.is_empty() {
        return Err(bad("runtime", "is empty"));
    }
    if req.key.is_empty() {
        return Err(bad("key", "is empty"));
    }
    Ok(())
}

/// The TrainJob for one attempt of a stage. Pure: the same request gives the same object.
///
/// The caller checks the request with [`validate_request`] first; reserved `PET_*` variables
/// are never copied into the object. The command and the environment are literal: each `$`
/// is escaped from the kubelet's expansion ([`escape`]).
pub fn trainjob_manifest(req: &StageRequest, opts: &KubeOptions) -> Value {
    let name = trainjob_name(&req.pipeline, &req.stage, &req.key, req.attempt);
    let labels = stage_labels(req);

    let mut env: Vec<Value> = Vec::new();
    let mut push_env = |k: &str, v: &str| env.push(json!({"name": k, "value": escape(v)}));
    for (k, v) in &req.env {
        if RESERVED_ENV.contains(&k.as_str()) || k == "PYTHONPATH" {
            continue;
        }
        push_env(k, v);
    }
    if !req.env.contains_key("MFLOW_STAGE") {
        push_env("MFLOW_STAGE", &req.stage);
    }
    if !req.env.contains_key("MFLOW_ATTEMPT") {
        push_env("MFLOW_ATTEMPT", &req.attempt.to_string());
    }
    let zip = format!("{WORKLOADS_ROOT}/{WORKLOADS_ZIP}");
    let python_path = match (&req.workload_digest, req.env.get("PYTHONPATH")) {
        (Some(_), Some(p)) => Some(format!("{zip}:{p}")),
        (Some(_), None) => Some(zip),
        (None, p) => p.cloned(),
    };
    if let Some(p) = python_path {
        push_env("PYTHONPATH", &p);
    }

    let mut trainer = json!({
        "image": req.image,
        "command": [escape(&req.command[0])],
        "numNodes": req.num_nodes,
        "numProcPerNode": req.nproc_per_node,
        "env": env,
    });
    if req.command.len() > 1 {
        trainer["args"] = json!(req.command[1..].iter().map(|a| escape(a)).collect::<Vec<_>>());
    }
    if let Some(resources) = resources_per_node(req) {
        trainer["resourcesPerNode"] = resources;
    }

    let mut volumes = vec![
        json!({"name": "mflow-artifacts", "persistentVolumeClaim": {"claimName": opts.pvc}}),
        json!({"name": "dshm", "emptyDir": match &opts.shm_size {
            Some(size) => json!({"medium": "Memory", "sizeLimit": size}),
            None => json!({"medium": "Memory"}),
        }}),
    ];
    let mut mounts = vec![
        json!({"name": "mflow-artifacts", "mountPath": ARTIFACT_MOUNT}),
        json!({"name": "dshm", "mountPath": "/dev/shm"}),
    ];
    if let Some(digest) = &req.workload_digest {
        volumes.push(json!({"name": "mflow-workloads", "configMap": {"name": workloads_configmap_name(digest)}}));
        mounts.push(json!({"name": "mflow-workloads", "mountPath": WORKLOADS_ROOT, "readOnly": true}));
    }
    let mut pod_spec = json!({
        "volumes": volumes,
        "containers": [{"name": NODE, "volumeMounts": mounts}],
    });
    if let Some(sa) = &opts.service_account {
        pod_spec["serviceAccountName"] = json!(sa);
    }

    let patch = json!({
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {"template": {
            "metadata": {"labels": labels},
            "spec": {"replicatedJobs": [{
                "name": NODE,
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"template": {"metadata": {"labels": labels}, "spec": pod_spec}},
                },
            }]},
        }},
    });

    let mut spec = json!({
        "runtimeRef": {"apiGroup": TRAINER_GROUP, "kind": "ClusterTrainingRuntime", "name": req.runtime},
        "trainer": trainer,
        "runtimePatches": [patch],
    });
    let request_deadline = req.timeout.map(|t| (t.as_secs() + u64::from(t.subsec_nanos() > 0)).max(1) as i64);
    if let Some(deadline) = request_deadline.or(opts.active_deadline_seconds) {
        spec["activeDeadlineSeconds"] = json!(deadline);
    }
    let mut metadata = json!({"name": name, "labels": labels, "annotations": stage_annotations(req)});
    if let Some(ns) = &opts.namespace {
        metadata["namespace"] = json!(ns);
    }
    json!({
        "apiVersion": format!("{TRAINER_GROUP}/{TRAINER_VERSION}"),
        "kind": "TrainJob",
        "metadata": metadata,
        "spec": spec,
    })
}

/// Requests and limits of each node. GPUs and memory get equal requests and limits, so the
/// scheduler reserves what the stage will use; CPU is only requested, so it may burst.
fn resources_per_node(req: &StageRequest) -> Option<Value> {
    let mut requests = Map::new();
    let mut limits = Map::new();
    if let Some(cpu) = &req.cpus {
        requests.insert("cpu".into(), json!(cpu));
    }
    if let Some(mem) = &req.memory {
        requests.insert("memory".into(), json!(mem));
        limits.insert("memory".into(), json!(mem));
    }
    if req.gpus_per_node > 0 {
        requests.insert("nvidia.com/gpu".into(), json!(req.gpus_per_node.to_string()));
        limits.insert("nvidia.com/gpu".into(), json!(req.gpus_per_node.to_string()));
    }
    if requests.is_empty() && limits.is_empty() {
        return None;
    }
    let mut out = Map::new();
    if !requests.is_empty() {
        out.insert("requests".into(), Value::Object(requests));
    }
    if !limits.is_empty() {
        out.insert("limits".into(), Value::Object(limits));
    }
    Some(Value::Object(out))
}
