//! Following a stage on a real cluster: its pod deleted or evicted, the API server away and
//! back, and one stage over many nodes.

use std::time::Instant;

use k8s_openapi::api::core::v1::Node;
use mflow_e2e::{numbered, secs, wait_until, Case, Out, RunStatus, StageStatus};

use crate::pipeline::{message, outcomes};

/// Lines of mflow's own that a display must never show: raw library logging.
fn no_raw_logging(out: &Out) {
    for raw in ["ERROR kube_client", "WARN kube_client", "WARN mflow_kube", "ERROR mflow_kube"] {
        out.not_contains(raw);
    }
}

/// A stage pod deleted while its container runs (kubectl delete pod, as a drain without
/// eviction does), and one evicted through the Eviction API: each attempt is a disruption,
/// class infra, said as such, and the stage's infra retry runs it again to success.
pub fn stage_pod_deleted_is_infra(c: &Case) {
    let spec = c
        .spec(
            r#"[stages.deleted]
kind = "command"
retries = { max = 1, backoff = "1s", on = ["infra"] }
run = ["sh", "-c", "echo attempt $MFLOW_ATTEMPT; if [ $MFLOW_ATTEMPT = 1 ]; then sleep 600; fi; echo ok > $MFLOW_OUTPUT/x"]

[stages.evicted]
kind = "command"
needs = ["deleted"]
retries = { max = 1, backoff = "1s", on = ["infra"] }
run = ["sh", "-c", "echo attempt $MFLOW_ATTEMPT; if [ $MFLOW_ATTEMPT = 1 ]; then sleep 600; fi; echo ok > $MFLOW_OUTPUT/x"]
"#,
        )
        .write();
    let run = c.mflow(["run", &spec]).spawn();
    wait_until(secs(120), "the pod of stage deleted", || c.running_pod(Some("deleted")).is_some());
    wait_until(secs(60), "attempt 1 of deleted to print", || run.printed("deleted | [rank 0] attempt 1"));
    let pod = c.running_pod(Some("deleted")).expect("the pod of stage deleted");
    c.cluster().delete_pod(&pod, Some(5), false);
    wait_until(secs(180), "the pod of stage evicted", || c.running_pod(Some("evicted")).is_some());
    wait_until(secs(60), "attempt 1 of evicted to print", || run.printed("evicted | [rank 0] attempt 1"));
    let pod = c.running_pod(Some("evicted")).expect("the pod of stage evicted");
    c.cluster().evict_pod(&pod, Some(5));
    let out = run.wait();
    assert_eq!(out.code, 0, "exit code");
    let rec = c.record();
    assert_eq!(outcomes(&rec, "deleted"), ["infra", "success"], "attempts of the deleted stage");
    assert_eq!(outcomes(&rec, "evicted"), ["infra", "success"], "attempts of the evicted stage");
    let deleted = rec.stages["deleted"].attempts[0].message.clone().unwrap_or_default();
    assert!(deleted.contains("rank 0: pod "), "message: {deleted}");
    assert!(
        deleted.contains("was deleted while its container ran (it then exited with code 137 (SIGKILL))"),
        "message: {deleted}"
    );
    let evicted = rec.stages["evicted"].attempts[0].message.clone().unwrap_or_default();
    assert!(evicted.contains("was evicted (Eviction API)"), "message: {evicted}");
    out.contains("was deleted while its container ran").not_contains("user failures are not retried");
    no_raw_logging(&out);
    assert_eq!(rec.status, RunStatus::Succeeded);
    assert_eq!(c.trainjobs().len(), 4, "TrainJobs (two attempts of each stage)");
}

/// On kwok a deleted pod goes at once, its container never reported as ended: still a
/// disruption, and the message says that the pod was deleted.
pub fn pod_deleted_on_kwok_says_so(c: &Case) {
    let spec = c
        .spec(
            r#"[stages.slow]
kind = "command"
env = { MFLOW_E2E_DURATION = "120s" }
run = ["sh", "-c", "true"]
"#,
        )
        .write();
    let run = c.mflow(["run", &spec]).spawn();
    wait_until(secs(60), "the stage's pod to run", || c.running_pod(Some("slow")).is_some());
    c.cluster().delete_pod(&c.running_pod(Some("slow")).expect("the stage's pod"), None, false);
    let out = run.wait();
    assert_eq!(out.code, 3, "exit code of an infra failure");
    let rec = c.record();
    assert_eq!(outcomes(&rec, "slow"), ["infra"]);
    let msg = message(&rec, "slow");
    assert!(msg.contains("infra: rank 0: pod "), "message: {msg}");
    assert!(msg.contains("was deleted while its container ran"), "message: {msg}");
    out.contains("was deleted while its container ran");
}

/// The API server is stopped and started again in the middle of a stage: the display says once
/// that it is unreachable and once that it is back, with no raw library lines, and the attempt
/// log and `mflow logs` hold every line the container printed, each once.
pub fn log_stream_survives_apiserver_restart(c: &Case) {
    let spec = c
        .spec(
            r#"[stages.count]
kind = "command"
run = ["sh", "-c", "i=0; while [ $i -lt 150 ]; do echo line $i; i=$((i + 1)); sleep 0.2; done; echo $i > $MFLOW_OUTPUT/n"]
"#,
        )
        .write();
    let run = c.mflow(["run", &spec]).spawn();
    wait_until(secs(120), "line 10 of the stage", || {
        run.text().lines().any(|l| l.ends_with("count | [rank 0] line 10"))
    });
    let away = Instant::now();
    {
        let _back = ApiServerAway::new(c);
        std::thread::sleep(secs(6));
    }
    println!("the API server was away for {}s", away.elapsed().as_secs());
    let out = run.wait();
    assert_eq!(out.code, 0, "exit code");
    let rec = c.record();
    assert_eq!(rec.stages["count"].status, StageStatus::Succeeded);
    let n = std::fs::read_to_string(format!("{}/n", rec.stages["count"].output.as_deref().unwrap_or_default()));
    assert_eq!(n.unwrap_or_default().trim(), "150", "the stage's output");
    let want: Vec<String> = (0..150).map(|i| format!("[rank 0] line {i}")).collect();
    let log = c.attempt_log("count", 1);
    let logged: Vec<&str> = log.lines().filter(|l| l.starts_with("[rank 0] line ")).collect();
    assert_eq!(logged, want, "the attempt log, every line once and in order");
    let logs = c.mflow(["logs", "count", "--workdir"]).arg(c.workdir()).run();
    assert_eq!(numbered(&logs.text, "[rank 0] line "), want, "mflow logs");
    let shown: Vec<String> =
        numbered(&out.text, "count | [rank 0] line ").iter().map(|l| l.replacen("count | ", "", 1)).collect();
    assert_eq!(shown, want, "the display");
    assert_eq!(out.count_lines("cannot be reached since"), 1, "lines saying the API server is away");
    out.contains("mflow keeps trying");
    assert_eq!(out.count_lines("answers again"), 1, "lines saying it is back");
    no_raw_logging(&out);
}

/// The API server stopped while it lives, started again when it is dropped.
struct ApiServerAway<'a>(&'a Case);

impl<'a> ApiServerAway<'a> {
    fn new(c: &'a Case) -> Self {
        let away = ApiServerAway(c);
        c.suite.script("cluster.sh", &["stop", "kube-apiserver"]);
        away
    }
}

impl Drop for ApiServerAway<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.0.suite.try_script("cluster.sh", &["start", "kube-apiserver"]) {
            assert!(std::thread::panicking(), "the API server did not come back: {e}");
        }
    }
}

/// `n` more kwok nodes like localhost (8 GPUs, 32 CPUs each), named kwok-node-I.
fn fake_node(i: usize) -> Node {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": format!("kwok-node-{i}"),
            "labels": {"kubernetes.io/hostname": format!("kwok-node-{i}"), "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64", "type": "kwok", "mflow-e2e/mode": "kwok", "mflow-e2e/fake": "true"},
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "status": {
            "capacity": {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "8", "ephemeral-storage": "1Ti"},
            "allocatable": {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "8", "ephemeral-storage": "1Ti"},
        },
    }))
    .expect("a Node")
}

/// The fake nodes, deleted when the case ends (and waited for, so that no later case sees them).
struct FakeNodes<'a>(&'a Case);

impl Drop for FakeNodes<'_> {
    fn drop(&mut self) {
        let cluster = self.0.cluster();
        cluster.delete_nodes("mflow-e2e/fake=true");
        let gone = mflow_e2e::wait_for(secs(120), || cluster.nodes("mflow-e2e/fake=true").is_empty());
        assert!(gone || std::thread::panicking(), "the fake nodes are still there after 120s");
    }
}

fn ready(node: &Node) -> bool {
    let conditions = node.status.as_ref().and_then(|s| s.conditions.as_ref());
    conditions.into_iter().flatten().any(|c| c.type_ == "Ready" && c.status == "True")
}

const MANY_NODES: &str = r#"[env]
python = "python3"

[stages.shards]
kind = "command"
run = ["sh", "-c", "true"]

[stages.data]
kind = "command"
run = ["sh", "-c", "true"]

[stages.train]
kind = "train"
model = "${stages.shards.output}"
data = "${stages.data.output}"
tp = 8
pp = 2
dp = 32
nodes = 64
micro_batch_size = 1
global_batch_size = 32
resources = { gpus = 8 }
env = { MFLOW_E2E_DURATION = "20s" }
"#;

/// One train stage over 64 kwok nodes of 8 GPUs: tp 8 x pp 2 x dp 32 = 512 ranks, 8 per node.
/// mflow runs as mflow-user, whose requests alone fall in API Priority and Fairness's
/// global-default flow (the controllers are system:masters, the kubelet a node), so the API
/// server's own counters measure mflow: log streams (only mflow reads pod logs), requests per
/// second, and the lines it shows. Bounds: at most 4 log requests (rank 0's stream, its last
/// read, and a reopening), at most 3 requests/s on average, at most 12 state lines of the stage.
pub fn many_nodes_kwok(c: &Case) {
    let cluster = c.cluster();
    let _nodes = FakeNodes(c);
    for i in 1..=63 {
        cluster.create_node(&fake_node(i));
    }
    wait_until(secs(120), "64 Ready kwok nodes", || {
        cluster.nodes("type=kwok").iter().filter(|n| ready(n)).count() >= 64
    });
    let spec = c.spec(MANY_NODES).kube(&format!("train_image = \"{}\"", c.suite.image)).write();
    let (logs0, reqs0) = (
        cluster.metric("apiserver_request_total", "subresource=\"log\""),
        cluster.metric("apiserver_flowcontrol_dispatched_requests_total", "flow_schema=\"global-default\""),
    );
    let t0 = Instant::now();
    let out = c.mflow(["run", &spec]).kubeconfig(c.suite.kubeconfig("mflow-user")).spawn().wait();
    let wall = t0.elapsed().as_secs_f64();
    let streams = cluster.metric("apiserver_request_total", "subresource=\"log\"") - logs0;
    let reqs =
        cluster.metric("apiserver_flowcontrol_dispatched_requests_total", "flow_schema=\"global-default\"") - reqs0;
    let states = out
        .text
        .lines()
        .filter_map(|l| l.find("train | mflow: TrainJob ").map(|at| &l[at..]))
        .filter(|rest| ["running on", "pending", "starting", "pods finished on"].iter().any(|s| rest.contains(s)))
        .count();
    let lines = out.text.lines().count();
    let rate = reqs as f64 / wall;
    println!(
        "measured: wall {wall:.1}s, log requests {streams}, mflow's API requests {reqs} ({rate:.2}/s), \
         state lines of train {states}, lines shown {lines}"
    );
    assert_eq!(out.code, 0, "exit code");
    assert_eq!(c.record().stages["train"].status, StageStatus::Succeeded);
    let job = &cluster.trainjobs(&c.stage_selector("train"))[0];
    assert_eq!(job.trainer().num_nodes, Some(64), "numNodes");
    assert_eq!(job.trainer().num_proc_per_node, Some(8), "numProcPerNode");
    out.contains("running on 64/64 nodes");
    assert!((1..=4).contains(&streams), "log requests: {streams}, bound 1..4");
    assert!(rate <= 3.0, "mflow's API requests: {rate:.2}/s, bound 3/s");
    assert!(states <= 12, "state lines of train: {states}, bound 12");
    assert!(lines <= 60, "lines shown: {lines}, bound 60");
    out.not_contains("[rank 1]");
}
