//! The backend against an in-process API server and a fake Trainer controller.

mod support;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use mflow_kube::{
    trainjob_name, CacheEntry, FailureClass, KubeBackend, KubeError, KubeOptions, LogLine, Outcome, StageRequest,
};
use serde_json::{json, Value};
use support::controller::{self, Scenario};
use support::fake_api::FakeApi;
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;

const NS: &str = "ml";
const LIMIT: Duration = Duration::from_secs(20);

struct Cluster {
    api: FakeApi,
    dir: tempfile::TempDir,
    _controller: tokio::task::JoinHandle<()>,
}

impl Cluster {
    async fn start(scenarios: HashMap<&'static str, Scenario>) -> Cluster {
        let api = FakeApi::start().await;
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/kubernetes/runtime.yaml");
        let runtime: Value = serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        api.add_runtime(runtime);
        api.add_pvc(NS, "mflow-artifacts");
        let controller = controller::spawn(api.shared.clone(), controller::by_stage(scenarios));
        Cluster { api, dir: tempfile::tempdir().unwrap(), _controller: controller }
    }

    fn options(&self) -> KubeOptions {
        KubeOptions {
            kubeconfig: Some(self.api.kubeconfig(self.dir.path(), NS)),
            log_drain: Duration::from_secs(3),
            ..KubeOptions::default()
        }
    }

    async fn backend(&self) -> KubeBackend {
        KubeBackend::connect(self.options()).await.expect("connect")
    }
}

fn request(stage: &str, kind: &str, nodes: u32) -> StageRequest {
    let key = blake3::hash(stage.as_bytes()).to_hex().to_string();
    StageRequest {
        pipeline: "gpt-tp2".into(),
        stage: stage.into(),
        key,
        attempt: 1,
        kind: kind.into(),
        image: "ghcr.io/mflow-dev/mflow:0.1.0".into(),
        command: vec!["mflow".into(), "stage".into(), stage.into()],
        env: BTreeMap::from([("MFLOW_OUTPUT".to_string(), format!("/mflow/staging/{stage}"))]),
        num_nodes: nodes,
        nproc_per_node: 1,
        gpus_per_node: 0,
        cpus: Some("2".into()),
        memory: Some("4Gi".into()),
        runtime: "mflow-torch".into(),
        workload_digest: None,
        timeout: None,
    }
}

/// Runs a stage and gathers its log lines.
async fn run(backend: &KubeBackend, req: &StageRequest) -> (Result<Outcome, KubeError>, Vec<LogLine>) {
    let (tx, mut rx) = mpsc::channel(1024);
    let collect = tokio::spawn(async move {
        let mut lines = Vec::new();
        while let Some(line) = rx.recv().await {
            lines.push(line);
        }
        lines
    });
    let outcome =
        tokio::time::timeout(LIMIT, backend.run(req, tx, CancellationToken::new())).await.expect("run timed out");
    (outcome, collect.await.unwrap())
}

fn failed(outcome: Outcome) -> (FailureClass, String) {
    match outcome {
        Outcome::Failed { class, message } => (class, message),
        other => panic!("expected a failure, got {other:?}"),
    }
}

#[tokio::test]
async fn preflight_passes_on_a_ready_cluster() {
    let cluster = Cluster::start(HashMap::new()).await;
    cluster.backend().await.preflight().await.expect("preflight");
}

#[tokio::test]
async fn a_chain_of_stages_runs_to_completion() {
    let cluster = Cluster::start(HashMap::new()).await;
    let backend = cluster.backend().await;
    let chain = [
        ("model", "model", 1),
        ("convert", "convert", 1),
        ("dataset", "dataset", 1),
        ("train", "train", 2),
        ("evaluate", "evaluate", 1),
        ("export", "export", 1),
    ];
    for (stage, kind, nodes) in chain {
        let req = request(stage, kind, nodes);
        let (outcome, logs) = run(&backend, &req).await;
        assert_eq!(outcome.expect(stage), Outcome::Succeeded, "{stage}");
        let name = trainjob_name(&req.pipeline, stage, &req.key, 1);
        let job = cluster.api.shared.get("trainjobs", NS, &name).expect("TrainJob exists");
        assert_eq!(job["metadata"]["labels"]["mflow.dev/stage"], stage);
        // Rank 0 is followed; the other ranks' logs are read only when they fail.
        assert_eq!(logs.iter().filter(|l| l.rank == Some(0)).count(), 3, "{stage}: {logs:?}");
        assert_eq!(
            logs.iter().filter(|l| l.rank.is_some_and(|r| r > 0)).count(),
            0,
            "{stage} on {nodes} nodes: {logs:?}"
        );
        assert!(logs.iter().any(|l| l.line.contains("completed")), "{logs:?}");
    }
    // Pods carry mflow's labels through the runtime patch.
    let pods = cluster.api.shared.list("pods", NS);
    assert!(pods.iter().all(|p| p["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "mflow"));
    assert_eq!(
        cluster.api.shared.count_requests("POST /apis/trainer.kubeflow.org/v1alpha1/namespaces/ml/trainjobs"),
        6
    );
}

#[tokio::test]
async fn rank_0_logs_stream_with_rank_prefixes() {
    let cluster = Cluster::start(HashMap::new()).await;
    let backend = cluster.backend().await;
    let (outcome, logs) = run(&backend, &request("train", "train", 3)).await;
    assert_eq!(outcome.unwrap(), Outcome::Succeeded);
    let shown: Vec<String> = logs.iter().filter(|l| l.rank.is_some()).map(ToString::to_string).collect();
    assert_eq!(shown, ["[rank 0] step 0 on node 0", "[rank 0] step 1 on node 0", "[rank 0] step 2 on node 0"]);
    // mflow's own lines carry no rank.
    assert!(logs.iter().any(|l| l.rank.is_none() && l.line.starts_with("mflow: submitted TrainJob")));
}

#[tokio::test]
async fn logs_follow_a_restarted_container() {
    let cluster = Cluster::start(HashMap::from([
        ("train", Scenario::RestartThenSucceed { rank: 0 }),
        ("other", Scenario::RestartThenSucceed { rank: 1 }),
    ]))
    .await;
    let backend = cluster.backend().await;
    let (outcome, logs) = run(&backend, &request("train", "train", 2)).await;
    assert_eq!(outcome.unwrap(), Outcome::Succeeded);
    let rank0: Vec<&str> = logs.iter().filter(|l| l.rank == Some(0)).map(|l| l.line.as_str()).collect();
    let crash = rank0.iter().position(|l| l.contains("watchdog")).expect("output before the restart");
    let resumed = rank0.iter().position(|l| *l == "resumed node 0 after restart 1").expect("output after the restart");
    assert!(crash < resumed, "{rank0:#?}");
    assert_eq!(rank0.iter().filter(|l| l.contains("watchdog")).count(), 1, "{rank0:#?}");
    // Another rank is not followed, but the whole log of its failed container is read.
    let (outcome, logs) = run(&backend, &request("other", "train", 2)).await;
    assert_eq!(outcome.unwrap(), Outcome::Succeeded);
    let rank1: Vec<&str> = logs.iter().filter(|l| l.rank == Some(1)).map(|l| l.line.as_str()).collect();
    assert_eq!(rank1, ["step 0 on node 1", "step 1 on node 1", "step 2 on node 1", "NCCL watchdog timeout; exiting"]);
}

#[tokio::test]
async fn failures_are_classified() {
    let scenarios = HashMap::from([
        ("user", Scenario::Exit { rank: 1, code: 3 }),
        ("oom", Scenario::Oom { rank: 0 }),
        ("evicted", Scenario::Evicted { rank: 1 }),
        ("deadline", Scenario::Deadline),
        ("badimage", Scenario::BadImage),
        ("deleted", Scenario::Deleted { rank: 0, killed: true }),
        ("vanished", Scenario::Deleted { rank: 1, killed: false }),
    ]);
    let cluster = Cluster::start(scenarios).await;
    let backend = cluster.backend().await;

    let (outcome, logs) = run(&backend, &request("user", "train", 2)).await;
    let (class, message) = failed(outcome.unwrap());
    assert_eq!(class, FailureClass::User);
    assert!(message.contains("rank 1") && message.contains("exited with code 3"), "{message}");
    assert!(logs.iter().any(|l| l.rank == Some(1) && l.line.starts_with("ValueError")), "{logs:?}");

    let (class, message) = failed(run(&backend, &request("oom", "train", 2)).await.0.unwrap());
    assert_eq!(class, FailureClass::Oom, "{message}");
    assert!(message.contains("rank 0") && message.contains("OOMKilled"), "{message}");

    let (class, message) = failed(run(&backend, &request("evicted", "train", 2)).await.0.unwrap());
    assert_eq!(class, FailureClass::Infra, "{message}");
    assert!(message.contains("Evicted"), "{message}");

    // A pod deleted while it ran (kubectl delete pod, a drain): a disruption, said as such.
    let (class, message) = failed(run(&backend, &request("deleted", "train", 2)).await.0.unwrap());
    assert_eq!(class, FailureClass::Infra, "{message}");
    assert!(
        message.starts_with("rank 0: pod ")
            && message.contains("was deleted while its container ran (it then exited with code 137 (SIGKILL))"),
        "{message}"
    );
    let (class, message) = failed(run(&backend, &request("vanished", "train", 2)).await.0.unwrap());
    assert_eq!(class, FailureClass::Infra, "{message}");
    assert!(
        message.starts_with("rank 1: pod ") && message.ends_with("was deleted while its container ran"),
        "{message}"
    );

    let (class, _) = failed(run(&backend, &request("deadline", "train", 1)).await.0.unwrap());
    assert_eq!(class, FailureClass::Timeout);

    let (class, message) = failed(run(&backend, &request("badimage", "convert", 1)).await.0.unwrap());
    assert_eq!(class, FailureClass::User);
    assert!(message.contains("InvalidImageName"), "{message}");
}

#[tokio::test]
async fn reattaches_after_the_client_is_recreated_mid_run() {
    let release = Arc::new(Notify::new());
    let cluster = Cluster::start(HashMap::from([("train", Scenario::HoldThenSucceed(release.clone()))])).await;
    let req = request("train", "train", 2);

    // First mflow process: runs until it has seen output, then dies.
    let first = cluster.backend().await;
    let (tx, mut rx) = mpsc::channel(1024);
    let req1 = req.clone();
    let task = tokio::spawn(async move { first.run(&req1, tx, CancellationToken::new()).await });
    loop {
        let line = tokio::time::timeout(LIMIT, rx.recv()).await.unwrap().unwrap();
        if line.rank.is_some() {
            break;
        }
    }
    task.abort();
    let _ = task.await;
    drop(rx);

    // Second process: same request, fresh client.
    let second = cluster.backend().await;
    let releaser = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        release.notify_one();
    });
    let (outcome, logs) = run(&second, &req).await;
    releaser.await.unwrap();
    assert_eq!(outcome.unwrap(), Outcome::Succeeded);
    assert!(logs.iter().any(|l| l.line.starts_with("mflow: reattaching to TrainJob")), "{logs:?}");
    // Rank 0 is followed to its end; the other ranks succeeded, so their logs are not read.
    assert!(logs.iter().any(|l| l.rank == Some(0) && l.line == "released node 0"), "{logs:?}");
    assert!(!logs.iter().any(|l| l.rank == Some(1)), "{logs:?}");
    assert_eq!(
        cluster.api.shared.count_requests("POST /apis/trainer.kubeflow.org/v1alpha1/namespaces/ml/trainjobs"),
        1
    );
}

#[tokio::test]
async fn a_completed_own_trainjob_is_not_rerun_and_a_failed_one_is_resubmitted() {
    let cluster = Cluster::start(HashMap::from([("flaky", Scenario::Exit { rank: 0, code: 1 })])).await;
    let backend = cluster.backend().await;
    let ok = request("ok", "convert", 1);
    assert_eq!(run(&backend, &ok).await.0.unwrap(), Outcome::Succeeded);
    let (again, logs) = run(&backend, &ok).await;
    assert_eq!(again.unwrap(), Outcome::Succeeded);
    assert!(logs.iter().any(|l| l.line.contains("already completed")));

    let flaky = request("flaky", "convert", 1);
    assert!(matches!(run(&backend, &flaky).await.0.unwrap(), Outcome::Failed { .. }));
    let (_, logs) = run(&backend, &flaky).await;
    assert!(logs.iter().any(|l| l.line.contains("which failed in an earlier run")), "{logs:?}");
    assert_eq!(
        cluster.api.shared.count_requests("POST /apis/trainer.kubeflow.org/v1alpha1/namespaces/ml/trainjobs"),
        3
    );
}

#[tokio::test]
async fn a_same_named_foreign_trainjob_is_refused_and_kept() {
    let cluster = Cluster::start(HashMap::new()).await;
    let backend = cluster.backend().await;
    let req = request("train", "train", 1);
    let name = trainjob_name(&req.pipeline, &req.stage, &req.key, 1);
    let foreign = json!({"metadata": {"name": name, "labels": {"team": "vision"}},
        "spec": {"runtimeRef": {"name": "mflow-torch"}, "trainer": {"image": "busybox"}}});
    cluster.api.shared.insert("trainjobs", NS, foreign).unwrap();
    let (outcome, _) = run(&backend, &req).await;
    let err = outcome.unwrap_err();
    assert!(matches!(err, KubeError::ForeignObject { .. }), "{err}");
    assert!(cluster.api.shared.get("trainjobs", NS, &name).is_some(), "foreign TrainJob was deleted");
    assert_eq!(cluster.api.shared.count_requests("DELETE "), 0);
    insta::assert_snapshot!("foreign_trainjob", render(&err));
}

#[tokio::test]
async fn missing_permissions_are_named() {
    let cluster = Cluster::start(HashMap::new()).await;
    cluster.api.shared.deny("create", "trainjobs");
    cluster.api.shared.deny("get", "pods/log");
    let backend = cluster.backend().await;
    let err = backend.preflight().await.unwrap_err();
    insta::assert_snapshot!("forbidden_preflight", render(&err));
    let (outcome, _) = run(&backend, &request("convert", "convert", 1)).await;
    let err = outcome.unwrap_err();
    assert!(
        matches!(&err, KubeError::Forbidden { verb, resource, .. } if verb == "create" && resource == "trainjobs"),
        "{err}"
    );
    assert!(
        err.to_string().contains("cannot create resource \\\"trainjobs\\\"")
            || err.to_string().contains("cannot create resource"),
        "{err}"
    );
}

#[tokio::test]
async fn the_rbac_example_grants_all_mflow_needs() {
    let cluster = Cluster::start(HashMap::from([("user", Scenario::Exit { rank: 0, code: 1 })])).await;
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/kubernetes/rbac.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let docs: Vec<Value> =
        serde_yaml::Deserializer::from_str(&text).map(|d| serde::Deserialize::deserialize(d).unwrap()).collect();
    cluster.api.shared.enforce_rbac(&docs);
    let backend = cluster.backend().await;
    // Reading the CRD is not granted: the version check is skipped, the rest must pass.
    backend.preflight().await.expect("preflight under the example RBAC");
    for (stage, nodes) in [("convert", 1), ("train", 2)] {
        assert_eq!(run(&backend, &request(stage, stage, nodes)).await.0.unwrap(), Outcome::Succeeded);
    }
    assert_eq!(failed(run(&backend, &request("user", "train", 1)).await.0.unwrap()).0, FailureClass::User);
    backend
        .ensure_workloads("abcdef0123456789", &BTreeMap::from([("mflow_workloads/a.py".to_string(), String::new())]))
        .await
        .unwrap();
    let entry = CacheEntry {
        stage: "convert".into(),
        kind: "convert".into(),
        output: "o".into(),
        digest: None,
        bytes: None,
        created: "2026-11-30T00:00:00Z".into(),
        extra: BTreeMap::new(),
    };
    backend.cache_put("gpt-tp2", "00ff", &entry).await.unwrap();
    backend.cache_put("gpt-tp2", "00ff", &entry).await.unwrap();
    assert_eq!(backend.cache_list("gpt-tp2").await.unwrap().len(), 1);
    // And it grants no more than the documented verbs on TrainJobs.
    let role = docs.iter().find(|d| d["kind"] == "Role").unwrap();
    let trainjob_rule =
        role["rules"].as_array().unwrap().iter().find(|r| r["resources"] == json!(["trainjobs"])).unwrap();
    assert_eq!(trainjob_rule["verbs"], json!(["create", "get", "list", "watch", "delete"]));
}

#[tokio::test]
async fn a_denied_pod_watch_is_a_permission_error() {
    let cluster = Cluster::start(HashMap::new()).await;
    cluster.api.shared.deny("list", "pods");
    let backend = cluster.backend().await;
    let (outcome, _) = run(&backend, &request("convert", "convert", 1)).await;
    let err = outcome.unwrap_err();
    assert!(matches!(&err, KubeError::Forbidden { resource, .. } if resource == "pods"), "{err}");
}

#[tokio::test]
async fn preflight_explains_missing_pieces() {
    let cluster = Cluster::start(HashMap::new()).await;
    let opts = KubeOptions { runtimes: vec!["megatron".into()], ..cluster.options() };
    let err = KubeBackend::connect(opts).await.unwrap().preflight().await.unwrap_err();
    assert!(
        matches!(&err, KubeError::RuntimeMissing { available, .. } if available == &["mflow-torch".to_string()]),
        "{err}"
    );
    insta::assert_snapshot!("runtime_missing", render(&err));

    let opts = KubeOptions { pvc: "nowhere".into(), ..cluster.options() };
    let err = KubeBackend::connect(opts).await.unwrap().preflight().await.unwrap_err();
    assert!(matches!(err, KubeError::PvcMissing { .. }), "{err}");

    // A v2.1 CRD: podTemplateOverrides instead of runtimePatches.
    cluster.api.shared.modify("customresourcedefinitions", "", "trainjobs.trainer.kubeflow.org", |crd| {
        let spec = &mut crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
        let patches = spec.as_object_mut().unwrap().remove("runtimePatches").unwrap();
        spec["podTemplateOverrides"] = patches;
    });
    let err = cluster.backend().await.preflight().await.unwrap_err();
    assert!(matches!(err, KubeError::TrainerTooOld { .. }), "{err}");
    insta::assert_snapshot!("trainer_too_old", render(&err));

    cluster.api.shared.inner.lock().unwrap().trainer_installed = false;
    let err = cluster.backend().await.preflight().await.unwrap_err();
    assert!(matches!(err, KubeError::TrainerMissing { .. }), "{err}");
}

#[tokio::test]
async fn an_unreachable_cluster_is_reported() {
    let cluster = Cluster::start(HashMap::new()).await;
    let opts = cluster.options();
    drop(cluster.api);
    let err = KubeBackend::connect(opts).await.err().expect("connect must fail");
    assert!(matches!(err, KubeError::Unreachable { .. }), "{err}");
}

#[tokio::test]
async fn the_server_rejection_is_shown_with_the_stage() {
    let cluster = Cluster::start(HashMap::new()).await;
    let backend = cluster.backend().await;
    let mut req = request("convert", "convert", 1);
    req.runtime = "torch-distributed".into();
    let err = run(&backend, &req).await.0.unwrap_err();
    assert!(
        matches!(&err, KubeError::Invalid { stage, message, .. } if stage == "convert" && message.contains("clusterTrainingRuntime must be created")),
        "{err}"
    );
}

#[tokio::test]
async fn cancelling_deletes_the_trainjob() {
    let release = Arc::new(Notify::new());
    let cluster = Cluster::start(HashMap::from([("train", Scenario::HoldThenSucceed(release))])).await;
    let backend = cluster.backend().await;
    let req = request("train", "train", 1);
    let cancel = CancellationToken::new();
    let (tx, mut rx) = mpsc::channel::<LogLine>(1024);
    let trigger = cancel.clone();
    tokio::spawn(async move {
        while let Some(line) = rx.recv().await {
            if line.rank.is_some() {
                trigger.cancel();
            }
        }
    });
    let outcome = tokio::time::timeout(LIMIT, backend.run(&req, tx, cancel)).await.unwrap().unwrap();
    assert_eq!(failed(outcome).0, FailureClass::Cancelled);
    let name = trainjob_name(&req.pipeline, &req.stage, &req.key, 1);
    assert!(cluster.api.shared.get("trainjobs", NS, &name).is_none());
}

#[tokio::test]
async fn a_trainjob_deleted_by_someone_else_is_an_infra_failure() {
    let release = Arc::new(Notify::new());
    let cluster = Cluster::start(HashMap::from([("train", Scenario::HoldThenSucceed(release))])).await;
    let backend = cluster.backend().await;
    let req = request("train", "train", 1);
    let name = trainjob_name(&req.pipeline, &req.stage, &req.key, 1);
    let (tx, mut rx) = mpsc::channel::<LogLine>(1024);
    let shared = cluster.api.shared.clone();
    let doomed = name.clone();
    tokio::spawn(async move {
        while let Some(line) = rx.recv().await {
            if line.rank.is_some() {
                shared.remove("trainjobs", NS, &doomed);
            }
        }
    });
    let outcome = tokio::time::timeout(LIMIT, backend.run(&req, tx, CancellationToken::new())).await.unwrap().unwrap();
    let (class, message) = failed(outcome);
    assert_eq!(class, FailureClass::Infra);
    assert!(message.contains("deleted"), "{message}");
}

#[tokio::test]
async fn suspended_trainjobs_are_shown_as_queued() {
    let cluster = Cluster::start(HashMap::from([("train", Scenario::QueuedThenSucceed)])).await;
    let backend = cluster.backend().await;
    let (outcome, logs) = run(&backend, &request("train", "train", 1)).await;
    assert_eq!(outcome.unwrap(), Outcome::Succeeded);
    let states: Vec<&str> = logs.iter().filter(|l| l.rank.is_none()).map(|l| l.line.as_str()).collect();
    let queued = states.iter().position(|l| l.contains("is queued")).expect("queued shown");
    let running = states.iter().position(|l| l.contains("running on 1/1 nodes")).expect("running shown");
    assert!(queued < running, "{states:#?}");
}

#[tokio::test]
async fn unschedulable_pods_say_why() {
    let cluster = Cluster::start(HashMap::from([("train", Scenario::UnschedulableThenSucceed)])).await;
    let backend = cluster.backend().await;
    let (outcome, logs) = run(&backend, &request("train", "train", 2)).await;
    assert_eq!(outcome.unwrap(), Outcome::Succeeded);
    assert!(
        logs.iter().any(|l| l.rank.is_none()
            && l.line.contains("cannot be scheduled yet (0/3 nodes are available: 3 Insufficient nvidia.com/gpu.)")),
        "{logs:#?}"
    );
}

#[tokio::test]
async fn the_cache_index_lives_in_configmaps() {
    let cluster = Cluster::start(HashMap::new()).await;
    let backend = cluster.backend().await;
    let key = "4a5b6c7d8e9f00112233445566778899aabbccddeeff00112233445566778899";
    assert_eq!(backend.cache_get("gpt-tp2", key).await.unwrap(), None);
    let mut entry = CacheEntry {
        stage: "convert".into(),
        kind: "convert".into(),
        output: "cache/gpt-tp2/convert/4a5b6c7d".into(),
        digest: Some("blake3:0011".into()),
        bytes: Some(1234),
        created: "2026-11-30T00:00:00Z".into(),
        extra: BTreeMap::new(),
    };
    backend.cache_put("gpt-tp2", key, &entry).await.unwrap();
    assert_eq!(backend.cache_get("gpt-tp2", key).await.unwrap(), Some(entry.clone()));
    entry.bytes = Some(4321);
    backend.cache_put("gpt-tp2", key, &entry).await.unwrap();
    // A second client (another laptop) sees it by pipeline.
    let other = cluster.backend().await;
    let listed = other.cache_list("gpt-tp2").await.unwrap();
    assert_eq!(listed.get(key), Some(&entry));
    assert!(other.cache_list("other-pipeline").await.unwrap().is_empty());
    assert_eq!(other.cache_get("other-pipeline", key).await.unwrap(), None);
}

#[tokio::test]
async fn workloads_travel_as_a_content_named_configmap() {
    let cluster = Cluster::start(HashMap::new()).await;
    let backend = cluster.backend().await;
    let files = BTreeMap::from([
        ("mflow_workloads/__init__.py".to_string(), String::new()),
        ("mflow_workloads/reference/__init__.py".to_string(), String::new()),
        ("mflow_workloads/reference/model.py".to_string(), "ANSWER = 'from the zip'\n".to_string()),
    ]);
    backend.ensure_workloads("0123456789abcdef0123", &files).await.unwrap();
    backend.ensure_workloads("0123456789abcdef0123", &files).await.unwrap();
    let cm = cluster.api.shared.get("configmaps", NS, "mflow-workloads-0123456789abcdef").unwrap();
    assert_eq!(cm["immutable"], true);
    let cm: k8s_openapi::api::core::v1::ConfigMap = serde_json::from_value(cm).unwrap();
    let archive = &cm.binary_data.unwrap()["mflow_workloads.zip"].0;

    // Python imports the subpackage straight from the archive, as the stage pod will.
    let zip_path = cluster.dir.path().join("mflow_workloads.zip");
    std::fs::write(&zip_path, archive).unwrap();
    let python = std::env::var("MFLOW_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = std::process::Command::new(python)
        .env("PYTHONPATH", &zip_path)
        .args(["-c", "from mflow_workloads.reference.model import ANSWER; print(ANSWER)"])
        .output()
        .expect("python runs");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "from the zip", "{}", String::from_utf8_lossy(&out.stderr));

    let escaping = BTreeMap::from([("../etc/passwd".to_string(), String::new())]);
    let err = backend.ensure_workloads("fedcba9876543210", &escaping).await.unwrap_err();
    assert!(matches!(err, KubeError::BadWorkload { .. }), "{err}");

    // A same-named ConfigMap with other content is not ours to reuse.
    let other = BTreeMap::from([("mflow_workloads/x.py".to_string(), "x".to_string())]);
    let forged = json!({"metadata": {"name": "mflow-workloads-aaaaaaaaaaaaaaaa"}, "data": {"x": "y"}});
    cluster.api.shared.insert("configmaps", NS, forged).unwrap();
    let err = backend.ensure_workloads("aaaaaaaaaaaaaaaa", &other).await.unwrap_err();
    assert!(matches!(err, KubeError::ForeignObject { .. }), "{err}");

    // The stage mounts it.
    let mut req = request("train", "train", 1);
    req.workload_digest = Some("0123456789abcdef0123".into());
    assert_eq!(run(&backend, &req).await.0.unwrap(), Outcome::Succeeded);
    let job = cluster.api.shared.get("trainjobs", NS, &trainjob_name(&req.pipeline, "train", &req.key, 1)).unwrap();
    assert!(job.to_string().contains("mflow-workloads-0123456789abcdef"));
}

/// The diagnostic as a user sees it: message, code and help.
fn render(err: &KubeError) -> String {
    use miette::Diagnostic;
    format!(
        "{err}\ncode: {}\nhelp: {}",
        err.code().map(|c| c.to_string()).unwrap_or_default(),
        err.help().map(|h| h.to_string()).unwrap_or_default()
    )
}
