//! Following a TrainJob as a real cluster shows it: streams that break, an API server that goes
//! away, pods that are suspended, stuck or refused, and many nodes.

mod support;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use mflow_kube::{trainjob_name, FailureClass, KubeBackend, KubeOptions, LogLine, Outcome, StageRequest};
use serde_json::{json, Value};
use support::controller::{self, Scenario};
use support::fake_api::FakeApi;
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;

const NS: &str = "ml";
const LIMIT: Duration = Duration::from_secs(60);

async fn api() -> FakeApi {
    let api = FakeApi::start().await;
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/kubernetes/runtime.yaml");
    let runtime: Value = serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    api.add_runtime(runtime);
    api.add_pvc(NS, "mflow-artifacts");
    api
}

async fn backend(api: &FakeApi, dir: &tempfile::TempDir, tune: impl FnOnce(&mut KubeOptions)) -> KubeBackend {
    let mut opts = KubeOptions {
        kubeconfig: Some(api.kubeconfig(dir.path(), NS)),
        log_drain: Duration::from_secs(5),
        ..KubeOptions::default()
    };
    tune(&mut opts);
    KubeBackend::connect(opts).await.unwrap()
}

fn request(stage: &str, kind: &str, nodes: u32) -> StageRequest {
    StageRequest {
        pipeline: "demo".into(),
        stage: stage.into(),
        key: blake3::hash(stage.as_bytes()).to_hex().to_string(),
        attempt: 1,
        kind: kind.into(),
        image: "ghcr.io/mflow-dev/mflow:0.1.0".into(),
        command: vec!["mflow".into(), "stage".into(), stage.into()],
        env: BTreeMap::from([("MFLOW_OUTPUT".to_string(), format!("/mflow/staging/{stage}"))]),
        num_nodes: nodes,
        nproc_per_node: 1,
        runtime: "mflow-torch".into(),
        ..StageRequest::default()
    }
}

/// Runs a request in the background; the lines arrive on the receiver.
fn start(backend: &KubeBackend, req: &StageRequest) -> (tokio::task::JoinHandle<Outcome>, mpsc::Receiver<LogLine>) {
    let (tx, rx) = mpsc::channel(4096);
    let (backend, req) = (backend.clone(), req.clone());
    let task = tokio::spawn(async move { backend.run(&req, tx, CancellationToken::new()).await.expect("run") });
    (task, rx)
}

async fn finish(task: tokio::task::JoinHandle<Outcome>, mut rx: mpsc::Receiver<LogLine>) -> (Outcome, Vec<LogLine>) {
    let collect = tokio::spawn(async move {
        let mut lines = Vec::new();
        while let Some(l) = rx.recv().await {
            lines.push(l);
        }
        lines
    });
    let outcome = tokio::time::timeout(LIMIT, task).await.expect("run timed out").unwrap();
    (outcome, collect.await.unwrap())
}

fn own(lines: &[LogLine]) -> Vec<&str> {
    lines.iter().filter(|l| l.rank.is_none()).map(|l| l.line.as_str()).collect()
}

fn log_requests(api: &FakeApi) -> usize {
    api.shared.inner.lock().unwrap().requests.iter().filter(|r| r.ends_with("/log")).count()
}

/// The pods of the TrainJob of `req` as the fake controller names them.
fn pods_of(api: &FakeApi, req: &StageRequest) -> Vec<String> {
    let name = trainjob_name(&req.pipeline, &req.stage, &req.key, 1);
    api.shared
        .list("pods", NS)
        .into_iter()
        .filter(|p| p["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"] == name.as_str())
        .map(|p| p["metadata"]["name"].as_str().unwrap().to_string())
        .collect()
}

async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let t = tokio::time::Instant::now();
    while !cond() {
        assert!(t.elapsed() < LIMIT, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_restart_loses_no_line_and_is_said_once() {
    let api = api().await;
    let release = Arc::new(Notify::new());
    let _c = controller::spawn(
        api.shared.clone(),
        controller::by_stage(HashMap::from([("long", Scenario::HoldThenSucceed(release.clone()))])),
    );
    let dir = tempfile::tempdir().unwrap();
    let backend = backend(&api, &dir, |_| {}).await;
    let req = request("long", "command", 1);
    let (task, mut rx) = start(&backend, &req);
    let mut lines = Vec::new();
    while lines.iter().filter(|l: &&LogLine| l.rank == Some(0)).count() < 3 {
        lines.push(tokio::time::timeout(LIMIT, rx.recv()).await.unwrap().unwrap());
    }
    let pod = pods_of(&api, &req).remove(0);
    let mut printed: Vec<String> = (0..3).map(|s| format!("step {s} on node 0")).collect();
    let mut print = |text: String| {
        api.shared.append_log(NS, &pod, &text);
        printed.push(text);
    };
    print("before the restart".into());
    tokio::time::sleep(Duration::from_millis(200)).await;
    api.stop();
    for i in 0..5 {
        print(format!("while the API server is down {i}"));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    api.start_again().await;
    print("after the restart".into());
    tokio::time::sleep(Duration::from_millis(500)).await;
    release.notify_one();
    printed.push("released node 0".into());
    let (outcome, rest) = finish(task, rx).await;
    lines.extend(rest);
    assert_eq!(outcome, Outcome::Succeeded);
    let shown: Vec<&str> = lines.iter().filter(|l| l.rank == Some(0)).map(|l| l.line.as_str()).collect();
    assert_eq!(shown, printed, "every line once, in order");
    let said = own(&lines);
    let down: Vec<&&str> = said.iter().filter(|l| l.contains("cannot be reached since")).collect();
    assert_eq!(down.len(), 1, "{said:#?}");
    assert!(down[0].contains("mflow keeps trying"), "{}", down[0]);
    assert_eq!(said.iter().filter(|l| l.contains("answers again")).count(), 1, "{said:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_rank_0_is_followed_and_a_failed_rank_is_read_whole() {
    let api = api().await;
    let _c = controller::spawn(
        api.shared.clone(),
        controller::by_stage(HashMap::from([("train", Scenario::Exit { rank: 2, code: 3 })])),
    );
    let dir = tempfile::tempdir().unwrap();
    let backend = backend(&api, &dir, |_| {}).await;
    let (task, rx) = start(&backend, &request("train", "train", 4));
    let (outcome, lines) = finish(task, rx).await;
    assert!(matches!(outcome, Outcome::Failed { class: FailureClass::User, .. }), "{outcome:?}");
    let rank = |r: u32| lines.iter().filter(move |l| l.rank == Some(r)).map(|l| l.line.as_str()).collect::<Vec<_>>();
    assert_eq!(rank(0), ["step 0 on node 0", "step 1 on node 0", "step 2 on node 0"]);
    assert!(rank(1).is_empty() && rank(3).is_empty(), "{lines:#?}");
    assert_eq!(rank(2).first(), Some(&"step 0 on node 2"), "the failed rank's whole log");
    assert_eq!(rank(2).last(), Some(&"ValueError: num_layers must be divisible by pipeline size"));
    // One stream of rank 0 and its last read, one read of the failed rank.
    assert!(log_requests(&api) <= 4, "{} log requests", log_requests(&api));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_nodes_give_few_state_lines_and_one_stream() {
    let api = api().await;
    let _c = controller::spawn(api.shared.clone(), controller::by_stage(HashMap::new()));
    let dir = tempfile::tempdir().unwrap();
    let backend = backend(&api, &dir, |_| {}).await;
    let (task, rx) = start(&backend, &request("train", "train", 64));
    let (outcome, lines) = finish(task, rx).await;
    assert_eq!(outcome, Outcome::Succeeded);
    let said = own(&lines);
    let states =
        said.iter().filter(|l| l.contains("running on") || l.contains("pending") || l.contains("finished on")).count();
    assert!(states <= 6, "{states} state lines for 64 pods: {said:#?}");
    assert!(said.iter().any(|l| l.ends_with("running on 64/64 nodes") || l.contains("finished on 64/64")), "{said:#?}");
    assert!(lines.iter().all(|l| l.rank.is_none() || l.rank == Some(0)));
    assert!(log_requests(&api) <= 3, "{} log requests for 64 pods", log_requests(&api));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspension_is_said_live_pods_counted_and_the_resume_point_named() {
    let api = api().await;
    let _c = controller::spawn(
        api.shared.clone(),
        controller::by_stage(HashMap::from([
            ("train", Scenario::SuspendedWhileRunning),
            ("cmd", Scenario::SuspendedWhileRunning),
        ])),
    );
    let dir = tempfile::tempdir().unwrap();
    let backend = backend(&api, &dir, |_| {}).await;
    // The train stage's status file on the volume names its newest checkpoint.
    let status = dir.path().join("status.json");
    std::fs::write(&status, r#"{"checkpoint_iteration": 40, "resumed_from": null}"#).unwrap();
    let mut req = request("train", "train", 2);
    req.env.insert("MFLOW_STATUS".into(), status.to_string_lossy().to_string());
    let (task, rx) = start(&backend, &req);
    let (outcome, lines) = finish(task, rx).await;
    assert_eq!(outcome, Outcome::Succeeded);
    let said = own(&lines);
    let suspended = said.iter().position(|l| l.contains("is suspended")).expect("suspension said");
    let resumed = said
        .iter()
        .position(|l| {
            l.ends_with("was resumed: new pods run the stage again, from its newest checkpoint (iteration 40)")
        })
        .expect("resume said");
    assert!(suspended < resumed, "{said:#?}");
    for l in &said {
        if let Some((k, n)) =
            l.split("running on ").nth(1).and_then(|r| r.split(" nodes").next()).and_then(|r| r.split_once('/'))
        {
            assert!(k.parse::<u32>().unwrap() <= n.parse::<u32>().unwrap(), "deleted pods counted: {l}");
        }
    }
    assert!(lines.iter().any(|l| l.rank == Some(0) && l.line == "started again on node 0"), "the new pod is followed");

    let (task, rx) = start(&backend, &request("cmd", "command", 1));
    let (_, lines) = finish(task, rx).await;
    assert!(
        own(&lines).iter().any(|l| l.ends_with("was resumed: new pods run the stage again, from the beginning")),
        "{lines:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_whose_node_stops_reporting_is_said_not_running() {
    let api = api().await;
    let release = Arc::new(Notify::new());
    let _c = controller::spawn(
        api.shared.clone(),
        controller::by_stage(HashMap::from([("long", Scenario::HoldThenSucceed(release.clone()))])),
    );
    let dir = tempfile::tempdir().unwrap();
    let backend = backend(&api, &dir, |_| {}).await;
    let req = request("long", "command", 1);
    let (task, mut rx) = start(&backend, &req);
    let mut lines = Vec::new();
    while !lines.iter().any(|l: &LogLine| l.line.ends_with("running on 1/1 nodes")) {
        lines.push(tokio::time::timeout(LIMIT, rx.recv()).await.unwrap().unwrap());
    }
    let pod = pods_of(&api, &req).remove(0);
    api.shared.modify("pods", NS, &pod, |p| {
        p["spec"]["nodeName"] = json!("gpu-7");
        p["status"]["conditions"] =
            json!([{"type": "Ready", "status": "False", "lastTransitionTime": "2026-01-01T00:00:40Z"}]);
    });
    // The taint manager deleted it five minutes later; the grace period is long over.
    api.shared.modify("pods", NS, &pod, |p| {
        p["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:06:10Z");
        p["metadata"]["deletionGracePeriodSeconds"] = json!(30);
    });
    until("the stuck line", || {
        while let Ok(l) = rx.try_recv() {
            lines.push(l);
        }
        lines.iter().any(|l| l.line.contains("is stuck terminating"))
    })
    .await;
    release.notify_one();
    let (_, rest) = finish(task, rx).await;
    lines.extend(rest);
    let said = own(&lines);
    let stuck = said.iter().find(|l| l.contains("is stuck terminating")).unwrap();
    assert!(stuck.contains("running on 0/1 nodes;"), "a pod being deleted is not counted as running: {stuck}");
    assert!(
        stuck.contains(
            "since 00:05:40 UTC: its node gpu-7 is not ready, so nothing confirms that the container stopped"
        ),
        "{stuck}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_refusal_is_said_once_without_the_controller_hint() {
    // No controller: the Job controller's FailedCreate events are all there is.
    let api = api().await;
    let dir = tempfile::tempdir().unwrap();
    let backend = backend(&api, &dir, |o| {
        o.start_timeout = Duration::from_secs(3);
        o.event_poll = Duration::from_millis(100);
    })
    .await;
    let req = request("quota", "command", 1);
    let name = trainjob_name(&req.pipeline, &req.stage, &req.key, 1);
    let (task, rx) = start(&backend, &req);
    for (i, suffix) in ["x7k2p", "9qz4m", "b2c8d"].iter().enumerate() {
        let message = format!("Error creating: pods \"{name}-node-0-0-{suffix}\" is forbidden: exceeded quota: mflow-quota, requested: cpu=2, used: cpu=0, limited: cpu=1");
        let event = json!({"metadata": {"name": format!("{name}-node-0.{i}")}, "type": "Warning", "reason": "FailedCreate",
            "message": message, "involvedObject": {"kind": "Job", "name": format!("{name}-node-0"), "namespace": NS},
            "lastTimestamp": format!("2026-01-01T00:00:0{i}Z")});
        api.shared.insert("events", NS, event).unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let (outcome, lines) = finish(task, rx).await;
    let said = own(&lines);
    let refusals: Vec<&&str> = said.iter().filter(|l| l.contains("exceeded quota")).collect();
    assert_eq!(refusals.len(), 2, "once while waiting, once in the final word: {said:#?}");
    assert!(refusals[0].contains("is not starting: job ") && refusals[0].contains("FailedCreate"), "{}", refusals[0]);
    assert!(!said.iter().any(|l| l.contains("has no pods after")), "{said:#?}");
    let Outcome::Failed { class, message } = outcome else { panic!("{outcome:?}") };
    assert_eq!(class, FailureClass::Infra);
    assert!(message.contains("exceeded quota: mflow-quota"), "{message}");
}
