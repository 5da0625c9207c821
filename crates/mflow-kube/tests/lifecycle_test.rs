//! How a TrainJob's life ends when it does not go to plan: it never starts, or mflow is asked
//! to leave while it runs.

mod support;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use mflow_kube::{trainjob_name, FailureClass, KubeBackend, KubeOptions, LogLine, Outcome, StageRequest};
use serde_json::Value;
use support::controller::{self, Scenario};
use support::fake_api::FakeApi;
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;

const NS: &str = "ml";

async fn api() -> FakeApi {
    let api = FakeApi::start().await;
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/kubernetes/runtime-cpu.yaml");
    let runtime: Value = serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    api.add_runtime(runtime);
    api.add_pvc(NS, "mflow-artifacts");
    api
}

fn request(stage: &str) -> StageRequest {
    StageRequest {
        pipeline: "demo".into(),
        stage: stage.into(),
        key: blake3::hash(stage.as_bytes()).to_hex().to_string(),
        attempt: 1,
        kind: "command".into(),
        image: "busybox".into(),
        command: vec!["true".into()],
        env: BTreeMap::from([("MFLOW_OUTPUT".to_string(), format!("/mflow/out/{stage}"))]),
        num_nodes: 1,
        nproc_per_node: 1,
        runtime: "mflow-cpu".into(),
        ..StageRequest::default()
    }
}

fn collect(mut rx: mpsc::Receiver<LogLine>) -> tokio::task::JoinHandle<Vec<String>> {
    tokio::spawn(async move {
        let mut lines = Vec::new();
        while let Some(l) = rx.recv().await {
            lines.push(l.to_string());
        }
        lines
    })
}

#[tokio::test]
async fn a_trainjob_without_pods_is_given_up_as_infra_with_a_hint_and_deleted() {
    // No controller at all: nothing ever creates the JobSet or its pods.
    let api = api().await;
    let dir = tempfile::tempdir().unwrap();
    let opts = KubeOptions {
        kubeconfig: Some(api.kubeconfig(dir.path(), NS)),
        start_timeout: Duration::from_secs(2),
        event_poll: Duration::from_millis(100),
        ..KubeOptions::default()
    };
    let backend = KubeBackend::connect(opts).await.unwrap();
    let req = request("stuck");
    let (tx, rx) = mpsc::channel(64);
    let lines = collect(rx);
    let outcome = tokio::time::timeout(Duration::from_secs(20), backend.run(&req, tx, CancellationToken::new()))
        .await
        .unwrap()
        .unwrap();
    let Outcome::Failed { class, message } = outcome else { panic!("{outcome:?}") };
    assert_eq!(class, FailureClass::Infra, "{message}");
    assert!(message.contains("did not start within 2s"), "{message}");
    assert!(message.contains("start_timeout"), "the way forward is missing: {message}");
    let lines = lines.await.unwrap();
    assert!(lines.iter().any(|l| l.contains("has no pods after 1s") && l.contains("kubeflow-system")), "{lines:?}");
    let name = trainjob_name(&req.pipeline, &req.stage, &req.key, 1);
    assert!(api.shared.get("trainjobs", NS, &name).is_none(), "the stuck TrainJob was left behind");
}

#[tokio::test]
async fn detaching_leaves_the_trainjob_running_and_a_second_run_reattaches() {
    let api = api().await;
    let release = std::sync::Arc::new(Notify::new());
    let _controller = controller::spawn(
        api.shared.clone(),
        controller::by_stage(HashMap::from([("long", Scenario::HoldThenSucceed(release.clone()))])),
    );
    let dir = tempfile::tempdir().unwrap();
    let opts = KubeOptions {
        kubeconfig: Some(api.kubeconfig(dir.path(), NS)),
        log_drain: Duration::from_secs(2),
        ..KubeOptions::default()
    };
    let backend = KubeBackend::connect(opts).await.unwrap();
    let req = request("long");
    let name = trainjob_name(&req.pipeline, &req.stage, &req.key, 1);

    let (tx, rx) = mpsc::channel(64);
    let lines = collect(rx);
    let detach = CancellationToken::new();
    let first = {
        let (backend, req, detach) = (backend.clone(), req.clone(), detach.clone());
        tokio::spawn(async move { backend.run_until(&req, tx, CancellationToken::new(), detach).await })
    };
    while api.shared.list("pods", NS).is_empty() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    detach.cancel();
    let outcome = tokio::time::timeout(Duration::from_secs(10), first).await.unwrap().unwrap().unwrap();
    let Outcome::Detached { message } = outcome else { panic!("{outcome:?}") };
    assert!(message.contains("left running"), "{message}");
    assert!(lines.await.unwrap().iter().any(|l| l.contains("interrupted; TrainJob")));
    assert!(api.shared.get("trainjobs", NS, &name).is_some(), "detaching deleted the TrainJob");

    let (tx, rx) = mpsc::channel(64);
    let lines = collect(rx);
    let second = {
        let (backend, req) = (backend.clone(), req.clone());
        tokio::spawn(async move { backend.run(&req, tx, CancellationToken::new()).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    release.notify_waiters();
    release.notify_one();
    let outcome = tokio::time::timeout(Duration::from_secs(20), second).await.unwrap().unwrap().unwrap();
    assert_eq!(outcome, Outcome::Succeeded);
    assert!(lines.await.unwrap().iter().any(|l| l.contains("reattaching to TrainJob")));
    assert_eq!(
        api.shared.count_requests(&format!("POST /apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS}/trainjobs")),
        1
    );
}
