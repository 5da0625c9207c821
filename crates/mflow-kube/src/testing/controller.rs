//! A fake Trainer + JobSet + kubelet: moves TrainJobs through their conditions, creates the
//! trainer pods JobSet would create (names, labels, completion index), writes their logs and
//! ends them as the scenario says.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Map, Value};
use tokio::sync::Notify;

use super::fake_api::Shared;

#[derive(Clone)]
pub enum Scenario {
    Succeed,
    /// Rank `rank` exits with `code`; the Job fails and JobSet removes the other pods.
    Exit {
        rank: u32,
        code: i32,
    },
    Oom {
        rank: u32,
    },
    Evicted {
        rank: u32,
    },
    /// The pod of `rank` is deleted while it runs (`kubectl delete pod`): it gets a
    /// deletionTimestamp, then its container is killed (137) when `killed`, or it goes at once
    /// (as on kwok); the Job fails.
    Deleted {
        rank: u32,
        killed: bool,
    },
    Deadline,
    /// Suspended by a queue first, then admitted and succeeds.
    QueuedThenSucceed,
    /// Runs, is suspended (its pods deleted), is resumed with new pods, then succeeds.
    SuspendedWhileRunning,
    /// Runs until the notify is signalled, then succeeds.
    HoldThenSucceed(Arc<Notify>),
    /// The container of `rank` crashes once and is restarted in place by the kubelet (as with
    /// `restartPolicy: OnFailure` in `torch-distributed`), then all ranks succeed.
    RestartThenSucceed {
        rank: u32,
    },
    /// The pods wait for GPUs for a while before they are scheduled, then succeed.
    UnschedulableThenSucceed,
    /// The image name is invalid: pods wait forever.
    BadImage,
    /// Runs the TrainJob's command on this machine, once per node, with its env and the PET_*
    /// variables Trainer would inject (as if the artifact volume were mounted at the same
    /// paths); its output becomes the pod log and its exit code the pod's.
    Exec,
}

pub type Picker = Arc<dyn Fn(&Value) -> Scenario + Send + Sync>;

/// Scenario per stage name (label mflow.dev/stage), defaulting to success.
pub fn by_stage(map: HashMap<&'static str, Scenario>) -> Picker {
    let map = Arc::new(Mutex::new(map));
    Arc::new(move |job: &Value| {
        let stage = job["metadata"]["annotations"]["mflow.dev/stage-name"].as_str().unwrap_or_default();
        map.lock().unwrap().get(stage).cloned().unwrap_or(Scenario::Succeed)
    })
}

pub fn spawn(api: Arc<Shared>, pick: Picker) -> tokio::task::JoinHandle<()> {
    let mut changes = api.subscribe();
    tokio::spawn(async move {
        while let Ok(change) = changes.recv().await {
            if change.resource == "trainjobs" && change.kind == "ADDED" {
                let scenario = pick(&change.object);
                tokio::spawn(run(api.clone(), change.ns.clone(), change.object.clone(), scenario));
            }
        }
    })
}

const STEP: Duration = Duration::from_millis(25);

fn now() -> &'static str {
    "2026-01-01T00:00:01Z"
}

fn condition(ty: &str, status: &str, reason: &str, message: &str) -> Value {
    json!({"type": ty, "status": status, "reason": reason, "message": message, "lastTransitionTime": now()})
}

fn set_condition(api: &Shared, ns: &str, name: &str, cond: Value) -> bool {
    api.modify("trainjobs", ns, name, |job| {
        let conds = job["status"]["conditions"].as_array().cloned().unwrap_or_default();
        let mut conds: Vec<Value> = conds.into_iter().filter(|c| c["type"] != cond["type"]).collect();
        conds.push(cond.clone());
        job["status"]["conditions"] = json!(conds);
    })
}

/// Pod labels as JobSet sets them, plus those of the runtime patches' pod template.
fn pod_labels(job: &Value, rank: u32) -> Map<String, Value> {
    let name = job["metadata"]["name"].as_str().unwrap();
    let mut labels = Map::new();
    for patch in job["spec"]["runtimePatches"].as_array().into_iter().flatten() {
        for rj in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"].as_array().into_iter().flatten() {
            if rj["name"] == "node" {
                if let Some(l) = rj["template"]["spec"]["template"]["metadata"]["labels"].as_object() {
                    labels.extend(l.clone());
                }
            }
        }
    }
    labels.insert("jobset.sigs.k8s.io/jobset-name".into(), json!(name));
    labels.insert("jobset.sigs.k8s.io/replicatedjob-name".into(), json!("node"));
    labels.insert("jobset.sigs.k8s.io/job-index".into(), json!("0"));
    labels.insert("batch.kubernetes.io/job-completion-index".into(), json!(rank.to_string()));
    labels.insert("batch.kubernetes.io/job-name".into(), json!(format!("{name}-node-0")));
    labels
}

fn container_status(state: Value, restarts: u32) -> Value {
    json!([{"name": "node", "ready": state.get("running").is_some(), "restartCount": restarts,
            "image": "mflow:test", "imageID": "", "state": state}])
}

fn set_pod(api: &Shared, ns: &str, pod: &str, phase: &str, state: Value) -> bool {
    let restarts = api.inner.lock().unwrap().restarts.get(&(ns.to_string(), pod.to_string())).copied().unwrap_or(0);
    api.modify("pods", ns, pod, |p| {
        p["status"]["phase"] = json!(phase);
        p["status"]["containerStatuses"] = container_status(state.clone(), restarts);
    })
}

fn terminated(code: i32, reason: &str) -> Value {
    json!({"terminated": {"exitCode": code, "reason": reason, "startedAt": now(), "finishedAt": now()}})
}

async fn run(api: Arc<Shared>, ns: String, job: Value, scenario: Scenario) {
    let name = job["metadata"]["name"].as_str().unwrap().to_string();
    let nodes = job["spec"]["trainer"]["numNodes"].as_u64().unwrap_or(1) as u32;
    let image = job["spec"]["trainer"]["image"].as_str().unwrap_or_default().to_string();
    if matches!(scenario, Scenario::QueuedThenSucceed) {
        set_condition(&api, &ns, &name, condition("Suspended", "True", "Suspended", "TrainJob is suspended"));
        tokio::time::sleep(STEP * 4).await;
        set_condition(&api, &ns, &name, condition("Suspended", "False", "Resumed", "TrainJob is resumed"));
    }
    let mut pods: Vec<String> = Vec::new();
    for rank in 0..nodes {
        let pod = format!("{name}-node-0-{rank}-{}", &format!("{:05x}", rank * 7919 + 4242)[..5]);
        let index = rank.to_string();
        let obj = json!({
            "metadata": {"name": pod, "labels": pod_labels(&job, rank),
                "annotations": {"batch.kubernetes.io/job-completion-index": index}},
            "spec": {"containers": [{"name": "node", "image": image}], "restartPolicy": "Never",
                "hostname": format!("{name}-node-0-{rank}"), "subdomain": name},
            "status": {"phase": "Pending", "containerStatuses": container_status(json!({"waiting": {"reason": "ContainerCreating"}}), 0)},
        });
        if api.insert("pods", &ns, obj).is_err() {
            return;
        }
        pods.push(pod);
    }
    tokio::time::sleep(STEP).await;
    if matches!(scenario, Scenario::UnschedulableThenSucceed) {
        for pod in &pods {
            api.modify("pods", &ns, pod, |p| {
                p["status"]["conditions"] = json!([{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.", "lastTransitionTime": now()}]);
            });
        }
        tokio::time::sleep(STEP * 4).await;
        for pod in &pods {
            api.modify("pods", &ns, pod, |p| {
                p["status"]["conditions"] =
                    json!([{"type": "PodScheduled", "status": "True", "lastTransitionTime": now()}]);
            });
        }
    }
    if matches!(scenario, Scenario::BadImage) {
        for pod in &pods {
            set_pod(
                &api,
                &ns,
                pod,
                "Pending",
                json!({"waiting": {"reason": "InvalidImageName",
                "message": format!("Failed to apply default image tag \"{image}\": couldn't parse image name")}}),
            );
        }
        return;
    }
    for pod in &pods {
        set_pod(&api, &ns, pod, "Running", json!({"running": {"startedAt": now()}}));
    }
    if matches!(scenario, Scenario::Exec) {
        return exec(api, &ns, &name, &job, &pods).await;
    }
    for step in 0..3 {
        for (rank, pod) in pods.iter().enumerate() {
            api.append_log(&ns, pod, &format!("step {step} on node {rank}"));
        }
        tokio::time::sleep(STEP).await;
    }
    if matches!(scenario, Scenario::SuspendedWhileRunning)
        && !suspend_and_resume(&api, &ns, &name, &job, &image, &mut pods).await
    {
        return;
    }
    if let Scenario::HoldThenSucceed(release) = &scenario {
        release.notified().await;
        for (rank, pod) in pods.iter().enumerate() {
            api.append_log(&ns, pod, &format!("released node {rank}"));
        }
    }
    if let Scenario::RestartThenSucceed { rank } = &scenario {
        let pod = pods[*rank as usize].clone();
        api.append_log(&ns, &pod, "NCCL watchdog timeout; exiting");
        let restarts = api.restart_container(&ns, &pod);
        api.modify("pods", &ns, &pod, |p| {
            p["status"]["containerStatuses"] = json!([{"name": "node", "ready": true, "restartCount": restarts,
                "image": "mflow:test", "imageID": "", "state": {"running": {"startedAt": now()}},
                "lastState": terminated(1, "Error")}]);
        });
        tokio::time::sleep(STEP).await;
        api.append_log(&ns, &pod, &format!("resumed node {rank} after restart {restarts}"));
        tokio::time::sleep(STEP).await;
    }
    end(&api, &ns, &name, &pods, scenario).await;
}

/// Suspends the TrainJob while its pods run (they go away) and resumes it with new pods;
/// false when the API server is gone.
async fn suspend_and_resume(api: &Shared, ns: &str, name: &str, job: &Value, image: &str, pods: &mut [String]) -> bool {
    set_condition(api, ns, name, condition("Suspended", "True", "Suspended", "TrainJob is suspended"));
    for pod in pods.iter() {
        api.close_log(ns, pod);
        api.remove("pods", ns, pod);
    }
    tokio::time::sleep(STEP * 4).await;
    set_condition(api, ns, name, condition("Suspended", "False", "Resumed", "TrainJob is resumed"));
    for pod in pods.iter_mut() {
        let fresh = format!("{pod}r");
        let mut obj = json!({"metadata": {"name": fresh}});
        obj["metadata"]["labels"] = json!(pod_labels(job, pods_rank(pod)));
        obj["metadata"]["annotations"] =
            json!({"batch.kubernetes.io/job-completion-index": pods_rank(pod).to_string()});
        obj["spec"] = json!({"containers": [{"name": "node", "image": image}], "restartPolicy": "Never"});
        obj["status"] = json!({"phase": "Running", "containerStatuses": container_status(json!({"running": {"startedAt": now()}}), 0)});
        if api.insert("pods", ns, obj).is_err() {
            return false;
        }
        *pod = fresh;
    }
    for (rank, pod) in pods.iter().enumerate() {
        api.append_log(ns, pod, &format!("started again on node {rank}"));
    }
    tokio::time::sleep(STEP).await;
    true
}

/// The scenario's end: the pods finished (or failed as it says) and the TrainJob's condition.
async fn end(api: &Shared, ns: &str, name: &str, pods: &[String], scenario: Scenario) {
    let fail_rank = |rank: u32| pods[rank as usize].clone();
    let failed = |reason: &str, message: &str| {
        set_condition(api, ns, name, condition("Failed", "True", reason, message));
    };
    let drop_others = |keep: &str| {
        for pod in pods {
            if pod != keep {
                api.close_log(ns, pod);
                api.remove("pods", ns, pod);
            }
        }
    };
    match scenario {
        Scenario::Succeed
        | Scenario::QueuedThenSucceed
        | Scenario::SuspendedWhileRunning
        | Scenario::HoldThenSucceed(_)
        | Scenario::RestartThenSucceed { .. }
        | Scenario::UnschedulableThenSucceed => {
            for pod in pods {
                api.close_log(ns, pod);
                set_pod(api, ns, pod, "Succeeded", terminated(0, "Completed"));
            }
            tokio::time::sleep(STEP).await;
            api.modify("trainjobs", ns, name, |job| {
                job["status"]["jobsStatus"] =
                    json!([{"name": "node", "ready": 0, "succeeded": 1, "failed": 0, "active": 0, "suspended": 0}]);
            });
            set_condition(
                api,
                ns,
                name,
                condition("Complete", "True", "AllJobsCompleted", "jobset completed successfully"),
            );
        }
        Scenario::Exit { rank, code } => {
            let pod = fail_rank(rank);
            api.append_log(ns, &pod, "Traceback (most recent call last):");
            api.append_log(ns, &pod, "ValueError: num_layers must be divisible by pipeline size");
            api.close_log(ns, &pod);
            set_pod(api, ns, &pod, "Failed", terminated(code, "Error"));
            drop_others(&pod);
            failed("FailedJobs", "jobset failed due to one or more failed jobs");
        }
        Scenario::Oom { rank } => {
            let pod = fail_rank(rank);
            api.close_log(ns, &pod);
            set_pod(api, ns, &pod, "Failed", terminated(137, "OOMKilled"));
            drop_others(&pod);
            failed("FailedJobs", "jobset failed due to one or more failed jobs");
        }
        Scenario::Evicted { rank } => {
            let pod = fail_rank(rank);
            api.close_log(ns, &pod);
            api.modify("pods", ns, &pod, |p| {
                p["status"]["phase"] = json!("Failed");
                p["status"]["reason"] = json!("Evicted");
                p["status"]["message"] = json!("The node was low on resource: memory.");
                p["status"]["conditions"] = json!([{"type": "DisruptionTarget", "status": "True",
                    "reason": "TerminationByKubelet", "message": "The node was low on resource: memory.",
                    "lastTransitionTime": now()}]);
                p["status"]["containerStatuses"] = container_status(terminated(137, "Error"), 0);
            });
            drop_others(&pod);
            failed("FailedJobs", "jobset failed due to one or more failed jobs");
        }
        Scenario::Deleted { rank, killed } => {
            let pod = fail_rank(rank);
            api.modify("pods", ns, &pod, |p| {
                p["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:31Z");
                p["metadata"]["deletionGracePeriodSeconds"] = json!(30);
            });
            tokio::time::sleep(STEP).await;
            api.close_log(ns, &pod);
            if killed {
                api.modify("pods", ns, &pod, |p| {
                    p["status"]["phase"] = json!("Failed");
                    p["status"]["containerStatuses"] = container_status(
                        json!({"terminated": {"exitCode": 137, "reason": "Error", "startedAt": now(), "finishedAt": "2026-01-01T00:00:31Z"}}),
                        0,
                    );
                });
            }
            api.remove("pods", ns, &pod);
            drop_others(&pod);
            failed("FailedJobs", "jobset failed due to one or more failed jobs");
        }
        Scenario::Deadline => {
            failed("DeadlineExceeded", "TrainJob exceeded its active deadline");
            drop_others("");
        }
        Scenario::BadImage | Scenario::Exec => unreachable!(),
    }
}

/// The node rank in a pod name made by [`run`] (`<job>-node-0-<rank>-<suffix>`).
fn pods_rank(pod: &str) -> u32 {
    pod.rsplit('-').nth(1).and_then(|r| r.parse().ok()).unwrap_or(0)
}

/// The argv and environment of the trainer container as the kubelet starts it: each env value
/// expanded against the variables before it, then the command and args against them all
/// (`$(NAME)` and `$$`, see [`crate::expand`]).
fn as_the_kubelet_runs(trainer: &Value, injected: &[(&str, String)]) -> (Vec<String>, Vec<(String, String)>) {
    let mut env: Vec<(String, String)> = Vec::new();
    for var in trainer["env"].as_array().into_iter().flatten() {
        let value = crate::expand(var["value"].as_str().unwrap_or_default(), &|n| {
            env.iter().rev().find(|(k, _)| k == n).map(|(_, v)| v.clone())
        });
        env.push((var["name"].as_str().unwrap_or_default().to_string(), value));
    }
    env.extend(injected.iter().map(|(k, v)| (k.to_string(), v.clone())));
    let lookup = |n: &str| env.iter().rev().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let argv = trainer["command"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(trainer["args"].as_array().into_iter().flatten())
        .filter_map(|v| v.as_str().map(|a| crate::expand(a, &lookup)))
        .collect();
    (argv, env)
}

/// The local stand-in for the pods of [`Scenario::Exec`]: every rank's process runs to its end
/// (or until the TrainJob is deleted), then the TrainJob completes or fails like JobSet's would.
async fn exec(api: Arc<Shared>, ns: &str, name: &str, job: &Value, pods: &[String]) {
    let trainer = &job["spec"]["trainer"];
    let port =
        std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(29500);
    let mut ranks = tokio::task::JoinSet::new();
    for (rank, pod) in pods.iter().enumerate() {
        let pet = [
            ("PET_NNODES", pods.len().to_string()),
            ("PET_NPROC_PER_NODE", trainer["numProcPerNode"].as_u64().unwrap_or(1).to_string()),
            ("PET_NODE_RANK", rank.to_string()),
            ("PET_MASTER_ADDR", "127.0.0.1".to_string()),
            ("PET_MASTER_PORT", port.to_string()),
        ];
        let (argv, env) = as_the_kubelet_runs(trainer, &pet);
        let mut cmd = tokio::process::Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .envs(env)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let (api, ns, pod) = (api.clone(), ns.to_string(), pod.clone());
        ranks.spawn(async move {
            let Ok(mut child) = cmd.spawn() else { return (pod, 127) };
            let out = tokio::spawn(pipe(child.stdout.take().unwrap(), api.clone(), ns.clone(), pod.clone()));
            let err = tokio::spawn(pipe(child.stderr.take().unwrap(), api.clone(), ns.clone(), pod.clone()));
            let code = loop {
                tokio::select! {
                    status = child.wait() => break status.ok().and_then(|s| s.code()).unwrap_or(137),
                    _ = tokio::time::sleep(STEP) => {
                        // The TrainJob (and with it the pod) was deleted: the container is killed.
                        if api.get("pods", &ns, &pod).is_none() {
                            let _ = child.kill().await;
                            return (pod, 137);
                        }
                    }
                }
            };
            let _ = out.await;
            let _ = err.await;
            api.close_log(&ns, &pod);
            (pod, code)
        });
    }
    let mut failed: Option<(String, i32)> = None;
    while let Some(Ok((pod, code))) = ranks.join_next().await {
        if api.get("pods", ns, &pod).is_none() {
            return;
        }
        if code == 0 {
            set_pod(&api, ns, &pod, "Succeeded", terminated(0, "Completed"));
        } else {
            set_pod(&api, ns, &pod, "Failed", terminated(code, "Error"));
            failed.get_or_insert((pod, code));
        }
    }
    tokio::time::sleep(STEP).await;
    match failed {
        None => {
            set_condition(
                &api,
                ns,
                name,
                condition("Complete", "True", "AllJobsCompleted", "jobset completed successfully"),
            );
        }
        Some(_) => {
            set_condition(
                &api,
                ns,
                name,
                condition("Failed", "True", "FailedJobs", "jobset failed due to one or more failed jobs"),
            );
        }
    }
}

async fn pipe<R: tokio::io::AsyncRead + Unpin>(r: R, api: Arc<Shared>, ns: String, pod: String) {
    use tokio::io::AsyncBufReadExt;
    let mut lines = tokio::io::BufReader::new(r).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        api.append_log(&ns, &pod, &line);
    }
}
