//! The main job as TrainJobs on the real kubelet, from the images docker/Dockerfile builds
//! (images.sh): `cpu-train` trains, `cpu` runs the native stages and the driver.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use mflow_e2e::{secs, wait_until, Case, Lockfile, RunRecord, RunStatus, StageStatus, TrainJob};
use mflow_kube::{LABEL_KEY, LABEL_PIPELINE, LABEL_STAGE, POD_JOBSET_LABEL, POD_RANK_LABEL};

/// The attempt of a stage's TrainJob (mflow's label).
const LABEL_ATTEMPT: &str = "mflow.dev/attempt";

use crate::pipeline::outcomes;

/// The images in the node's containerd, and a volume that this mflow (root) and the pods of
/// those images (uid 1000) both write: the workdirs mflow makes here, and the upload area that
/// earlier cases' root pods made.
pub(crate) fn prepare_train_case(c: &Case) {
    for image in [&c.suite.train_image, &c.suite.cpu_image] {
        wait_until(secs(60), &format!("the node to list the image {image} (tests/e2e/kubernetes/images.sh)"), || {
            c.cluster().nodes("").iter().any(|n| {
                let images = n.status.as_ref().and_then(|s| s.images.as_ref());
                images.into_iter().flatten().flat_map(|i| i.names.iter().flatten()).any(|name| name == image)
            })
        });
    }
    // SAFETY: umask(2) only sets this process's file mode mask.
    unsafe { libc::umask(0) };
    let uploads = c.suite.volume.join(".mflow-uploads");
    if uploads.is_dir() {
        let status = Command::new("chmod").arg("-R").arg("a+rwX").arg(&uploads).status().expect("chmod");
        assert!(status.success(), "chmod -R a+rwX {}", uploads.display());
    }
}

/// A user's checkout of this repository (HEAD), made once per cluster: the main job reads its
/// docs and sources, which must not change between the runs a case compares.
pub(crate) fn checkout(c: &Case) -> PathBuf {
    let dir = c.suite.state.join("checkout");
    if !dir.join(".git").exists() {
        let tmp = c.suite.state.join("checkout.tmp");
        let _ = std::fs::remove_dir_all(&tmp);
        let status = Command::new("git")
            .args(["clone", "-q", "--shared"])
            .arg(&c.suite.repo)
            .arg(&tmp)
            .status()
            .expect("git clone");
        assert!(status.success(), "git clone {}", c.suite.repo.display());
        std::fs::rename(&tmp, &dir).expect("the checkout in place");
    }
    dir
}

/// With `MFLOW_E2E_MAIN_ITERATIONS`, the main job's iterations and the gates a run that short
/// can pass (those of the README's short walk); without it, the spec as it is.
fn short_run(c: &Case) -> Vec<String> {
    let Some(n) = &c.suite.main_iterations else { return Vec::new() };
    vec![
        format!("vars.iterations={n}"),
        "stages.evaluate.gates.val_ppl=< 200".into(),
        "stages.evaluate.gates.val_loss_delta_vs_baseline=< -1.0".into(),
    ]
}

/// `mflow run` arguments that point specs/gpt-tp2.toml at this cluster, as a user does from
/// outside it: backend, namespace, images and runtimes, the driver's way to the API server
/// (this cluster's pods reach it on the node's loopback only), and the iterations if given.
fn main_args(c: &Case) -> Vec<String> {
    let s = &c.suite;
    let mut sets = vec![
        format!("pipeline.kubernetes.namespace=\"{}\"", s.namespace),
        format!("pipeline.kubernetes.image=\"{}\"", s.cpu_image),
        format!("pipeline.kubernetes.train_image=\"{}\"", s.train_image),
        format!("pipeline.kubernetes.runtime=\"{}\"", s.torch_runtime),
        format!("pipeline.kubernetes.cpu_runtime=\"{}\"", s.cpu_runtime),
        "pipeline.kubernetes.driver.host_network=true".into(),
        "pipeline.kubernetes.driver.env.KUBERNETES_SERVICE_HOST=\"127.0.0.1\"".into(),
        "pipeline.kubernetes.driver.env.KUBERNETES_SERVICE_PORT=\"6443\"".into(),
    ];
    sets.extend(short_run(c));
    let mut args = vec!["--backend".to_string(), "kubernetes".into()];
    for set in sets {
        args.extend(["--set".into(), set]);
    }
    args
}

/// The run id a run from outside the cluster printed (`run ID: driver job/...`).
fn run_id_of(text: &str) -> String {
    let id =
        text.lines().find_map(|l| l.strip_prefix("run ")?.split_once(": driver job").map(|(id, _)| id.to_string()));
    id.filter(|id| !id.contains(' ')).expect("no run id in the output")
}

const MAIN: &str = "gpt-tp2";

fn main_workdir(c: &Case) -> PathBuf {
    c.suite.volume.join(MAIN)
}

fn main_record(c: &Case, run: &str) -> RunRecord {
    Case::record_in(&main_workdir(c), run)
}

/// specs/gpt-tp2.toml of a checkout, on this cluster, from outside it; returns the run id.
fn run_main(c: &Case, extra: &[&str]) -> String {
    let spec = checkout(c).join("specs/gpt-tp2.toml");
    let out = c.mflow(["run"]).arg(&spec).args(main_args(c)).args(extra).outside().run();
    out.contains("upload: ").contains("succeeded: ");
    run_id_of(&out.text)
}

/// The TrainJob of a stage's last attempt among those `selector` matches (a stage retried has
/// one per attempt: `-a2`, ...).
fn last_attempt(c: &Case, selector: &str) -> TrainJob {
    let attempt = |j: &TrainJob| j.label(LABEL_ATTEMPT).and_then(|a| a.parse::<u32>().ok()).unwrap_or(0);
    let jobs = c.cluster().trainjobs(selector);
    jobs.into_iter().max_by_key(attempt).unwrap_or_else(|| panic!("no TrainJob {selector}"))
}

/// The pods of the last attempt of the stage are torchrun on Trainer's torch runtime with the
/// topology in PET_* from the Trainer controller, and the master's name (a pod of the headless
/// Service) was resolved by the cluster's DNS.
fn check_torch_pods(c: &Case, selector: &str, nnodes: i32, nproc: i32) {
    let cluster = c.cluster();
    let job = last_attempt(c, selector);
    let tj = job.name().to_string();
    assert_eq!(job.spec.runtime_ref.name, c.suite.torch_runtime, "runtime of {tj}");
    assert_eq!(job.trainer().num_nodes, Some(nnodes), "numNodes of {tj}");
    assert_eq!(job.trainer().num_proc_per_node, Some(nproc), "numProcPerNode of {tj}");
    // mflow sets no PET_* itself: Trainer's webhook would refuse it.
    let pet: Vec<_> = job.trainer().env.iter().filter(|e| e.name.contains("PET_")).map(|e| e.name.clone()).collect();
    assert!(pet.is_empty(), "mflow set {pet:?} on {tj}");
    let pods = cluster.pods(&format!("{POD_JOBSET_LABEL}={tj}"));
    assert_eq!(pods.len(), nnodes as usize, "pods of {tj}");
    let mut ranks = Vec::new();
    for pod in &pods {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let container = &pod.spec.as_ref().expect("a pod spec").containers[0];
        // Trainer's trainer.command and .args become the container's.
        let command = container.command.iter().flatten().take(1).chain(container.args.iter().flatten().take(2));
        assert_eq!(
            command.cloned().collect::<Vec<_>>().join(" "),
            "python -m torch.distributed.run",
            "command of {name}"
        );
        let env = |n: &str| mflow_e2e::pod_env(pod, n);
        assert_eq!(env("PET_NNODES"), Some(nnodes.to_string()), "PET_NNODES of {name}");
        assert_eq!(env("PET_NPROC_PER_NODE"), Some(nproc.to_string()), "PET_NPROC_PER_NODE of {name}");
        assert_eq!(env("PET_MASTER_ADDR"), Some(format!("{tj}-node-0-0.{tj}")), "PET_MASTER_ADDR of {name}");
        assert_eq!(env("PET_MASTER_PORT").as_deref(), Some("29500"), "PET_MASTER_PORT of {name}");
        // The node rank is the pod's completion index, which Trainer passes by reference.
        assert_eq!(
            mflow_e2e::pod_env_field(pod, "PET_NODE_RANK").as_deref(),
            Some("metadata.annotations['batch.kubernetes.io/job-completion-index']"),
            "PET_NODE_RANK of {name}"
        );
        let annotations = pod.metadata.annotations.clone().unwrap_or_default();
        ranks.push(annotations.get(POD_RANK_LABEL).and_then(|r| r.parse::<i32>().ok()).unwrap_or(-1));
        let phase = pod.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default();
        assert_eq!(phase, "Succeeded", "phase of {name}");
    }
    ranks.sort();
    assert_eq!(ranks, (0..nnodes).collect::<Vec<_>>(), "PET_NODE_RANK of the pods");
    let dns = std::fs::read_to_string(c.suite.state.join("logs/dns.log")).unwrap_or_default();
    let answer = format!("A {tj}-node-0-0.{tj}.{}.svc.cluster.local -> 127.0.0.1", c.suite.namespace);
    assert!(dns.contains(&answer), "the cluster's DNS never answered {tj}-node-0-0.{tj}");
}

fn key32(rec: &RunRecord, stage: &str) -> String {
    rec.stages[stage].key.clone().unwrap_or_default().chars().take(32).collect()
}

/// Every stage succeeded (or was cached by an earlier case of this cluster); train, evaluate and
/// export were TrainJobs; the gates passed.
fn check_main_run(c: &Case, run: &str, nproc: i32) {
    let rec = main_record(c, run);
    assert_eq!(rec.status, RunStatus::Succeeded, "run status");
    for (name, stage) in &rec.stages {
        assert!(
            matches!(stage.status, StageStatus::Succeeded | StageStatus::Cached),
            "stage {name}: {:?}",
            stage.status
        );
    }
    assert_eq!(rec.stages["train"].status, StageStatus::Succeeded, "train");
    for stage in ["train", "evaluate", "export"] {
        let selector = format!("{LABEL_PIPELINE}={MAIN},{LABEL_STAGE}={stage},{LABEL_KEY}={}", key32(&rec, stage));
        let job = last_attempt(c, &selector);
        assert!(job.condition("Complete"), "TrainJob {} of {stage} Complete", job.name());
    }
    let train = format!("{LABEL_PIPELINE}={MAIN},{LABEL_STAGE}=train,{LABEL_KEY}={}", key32(&rec, "train"));
    check_torch_pods(c, &train, 1, nproc);
    let gates = &rec.stages["evaluate"].gates;
    for g in gates {
        println!("gate {} {}: {:?} {}", g.metric, g.condition, g.value, g.passed);
    }
    assert!(!gates.is_empty() && gates.iter().all(|g| g.passed), "gates passed");
    let export = rec.stages["export"].output.clone().unwrap_or_default();
    assert!(Path::new(&export).join("model.safetensors").is_file(), "export wrote no HF model");
}

/// Stage -> (key, output digest) of a run's lockfile.
fn stage_keys(lock: &Lockfile) -> BTreeMap<String, (String, Option<String>)> {
    lock.stages.iter().map(|(name, s)| (name.clone(), (s.key.clone(), s.output_digest.clone()))).collect()
}

/// The main job, as a user runs it from a checkout: model, convert, dataset, train (TP=2 on 2
/// gloo ranks in one pod), evaluate with its gates, export; then again, all cached; and the keys
/// and output digests are those a local run of the same spec leaves.
pub fn main_job_on_kubelet(c: &Case) {
    prepare_train_case(c);
    let t = Instant::now();
    let run = run_main(c, &[]);
    println!("cluster run {run}: {}s", t.elapsed().as_secs());
    check_main_run(c, &run, 2);
    let log = std::fs::read_to_string(main_workdir(c).join(format!("runs/{run}/stages/train/attempt-1.log")));
    assert!(log.unwrap_or_default().contains("[rank 0]"), "the train log has no line of rank 0");

    let dir = checkout(c);
    let again = c.mflow(["run"]).arg(dir.join("specs/gpt-tp2.toml")).args(main_args(c)).outside().run();
    again.contains("0 ran");
    let rec = main_record(c, &run_id_of(&again.text));
    crate::pipeline::all_stages(&rec, StageStatus::Cached);

    // The same spec run here, with the local backend, into the checkout's own workdir.
    let t = Instant::now();
    let mut local = c.mflow(["run", "specs/gpt-tp2.toml"]).dir(&dir).env_remove("MFLOW_PYTHON");
    local = local.env("MFLOW_HOME", &c.suite.local_home);
    for set in short_run(c) {
        local = local.args(["--set", set.as_str()]);
    }
    local.run();
    println!("local run: {}s", t.elapsed().as_secs());
    let local_workdir = dir.join("specs/.mflow");
    let here = stage_keys(&Case::lock_in(&local_workdir, Case::runs_in(&local_workdir).last().expect("a local run")));
    let there = stage_keys(&Case::lock_in(&main_workdir(c), &run));
    assert_eq!(here, there, "the cluster's keys and output digests (right) against the local run's (left)");
    println!("{there:#?}");
}

/// TP=2 x PP=2: 4 gloo ranks in one pod, the reshards planning inserts, to the end.
pub fn main_job_pp2_on_kubelet(c: &Case) {
    prepare_train_case(c);
    // 4 CPU ranks would ask for a core each, and this node has 2: the pod gets what the node has.
    let run = run_main(c, &["--set", "stages.train.pp=2", "--set", "stages.train.resources.cpus=2"]);
    check_main_run(c, &run, 4);
    assert_eq!(main_record(c, &run).stages["train-reshard"].status, StageStatus::Succeeded, "train-reshard");
}

/// Model, convert (TP=2), dataset and train as in specs/gpt-tp2.toml, on this repository's docs
/// (copied to the volume once, so that every run of a case hashes the same inputs), with a
/// checkpoint every 10 iterations. Returns the spec's path.
fn train_spec(c: &Case, nodes: u32, iterations: u32) -> String {
    let docs = c.suite.volume.join("e2e/train-docs");
    if !docs.is_dir() {
        let tmp = c.suite.volume.join("e2e/train-docs.tmp");
        std::fs::create_dir_all(&tmp).expect("a directory");
        for doc in glob::glob(&format!("{}/docs/*.md", c.suite.repo.display())).expect("a pattern").flatten() {
            std::fs::copy(&doc, tmp.join(doc.file_name().expect("a name"))).expect("a copy of a doc");
        }
        std::fs::rename(&tmp, &docs).expect("the docs in place");
    }
    let stages = include_str!("train-spec.toml")
        .replace("DOCS", &docs.display().to_string())
        .replace("NODES", &nodes.to_string())
        .replace("ITERATIONS", &iterations.to_string());
    c.spec(&stages).image(&c.suite.cpu_image).kube(&format!("train_image = \"{}\"", c.suite.train_image)).write()
}

/// The newest complete checkpoint of the case's train stage on the volume (the trainer writes
/// `iter_NNNNNNN/meta.json` last): the point after which taking the pod away must resume.
fn newest_checkpoint(c: &Case) -> Option<String> {
    let pattern = format!("{}/scratch/*/checkpoints/iter_*/meta.json", c.workdir().display());
    let mut found: Vec<PathBuf> = glob::glob(&pattern).expect("a pattern").flatten().collect();
    found.sort();
    found.pop().and_then(|p| Some(p.parent()?.file_name()?.to_string_lossy().into_owned()))
}

const RESUME_ITERATIONS: u32 = 60;

/// Takes the train pod away once training is past its first checkpoint, by `how`: `delete`
/// (as kubectl delete pod does) or `evict` (the Eviction API, as a drain does); mflow must end
/// with exit code 0. Returns what it printed.
fn interrupt_train(c: &Case, how: &str) -> String {
    let spec = train_spec(c, 1, RESUME_ITERATIONS);
    let run = c.mflow(["run", &spec]).spawn();
    wait_until(secs(400), "a checkpoint of the train stage", || newest_checkpoint(c).is_some());
    let pod = c.running_pod(Some("train")).expect("the running train pod");
    println!("taking pod {pod} away ({how}) after the checkpoint {}", newest_checkpoint(c).unwrap_or_default());
    match how {
        "delete" => c.cluster().delete_pod(&pod, None, true),
        _ => c.cluster().evict_pod(&pod, None),
    }
    let out = run.wait();
    assert_eq!(out.code, 0, "mflow's exit code after the pod was taken away ({how})");
    out.text
}

/// Attempt 1 was infra, attempt 2 resumed from the newest checkpoint of attempt 1 (not from 0).
fn check_resumed(c: &Case) {
    let rec = c.record();
    assert_eq!(outcomes(&rec, "train"), ["infra", "success"], "train attempts");
    let attempts = &rec.stages["train"].attempts;
    let ck = attempts[0].checkpoint_iteration.unwrap_or(0);
    assert!(ck > 0, "attempt 1 left no checkpoint");
    assert_eq!(attempts[1].resumed_from, Some(ck), "attempt 2 resumed from");
    let log = c.attempt_log("train", 2);
    assert!(log.contains(&format!("resumed from checkpoint at iteration {ck}")), "attempt 2's log:\n{log}");
    println!("{}: attempt 1 {}", c.name, attempts[0].message.clone().unwrap_or_default());
    println!("{}: resumed at iteration {ck} of {RESUME_ITERATIONS}", c.name);
}

/// The final loss and validation loss of the case's train stage, from its metrics (every
/// attempt's lines).
fn final_losses(c: &Case) -> (f64, f64) {
    let path = c.workdir().join("runs").join(c.newest_run()).join("stages/train/metrics.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let lines: Vec<serde_json::Value> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let last = |key: &str| lines.iter().rev().find_map(|v| v.get(key)?.as_f64());
    (last("loss").expect("a loss in the metrics"), last("val_loss").expect("a val_loss in the metrics"))
}

/// The train pod deleted mid-training, then evicted in another run: each time the attempt is
/// infra, retried, and the retry resumes from the newest checkpoint; the final losses are an
/// uninterrupted run's (within 1e-6, the resume tolerance of docs/validation.md).
pub fn train_pod_deleted_resumes(c: &Case) {
    prepare_train_case(c);
    let plain = c.part(&format!("{}_plain", c.name));
    plain.mflow(["run", &train_spec(&plain, 1, RESUME_ITERATIONS)]).run();
    let want = final_losses(&plain);
    println!("uninterrupted: final loss, val loss {want:?}");
    for how in ["delete", "evict"] {
        let part = c.part(&format!("{}_{how}", c.name));
        let out = interrupt_train(&part, how);
        assert!(out.contains("attempt 2"), "no attempt 2 in what mflow printed");
        check_resumed(&part);
        let got = final_losses(&part);
        let close = (got.0 - want.0).abs() <= 1e-6 && (got.1 - want.1).abs() <= 1e-6;
        assert!(close, "losses differ: resumed {got:?}, uninterrupted {want:?}");
    }
}

/// train with nodes = 2 (one rank per pod) on two kubelets: the pods land on two nodes and
/// find each other as Trainer's runtime tells them, through the headless Service's name.
pub fn train_on_two_nodes_kubelet(c: &Case) {
    prepare_train_case(c);
    let _node2 = SecondNode::start(c);
    let spec = train_spec(c, 2, 10);
    c.mflow(["run", &spec]).run();
    assert_eq!(c.record().stages["train"].status, StageStatus::Succeeded);
    check_torch_pods(c, &c.stage_selector("train"), 2, 1);
    let mut nodes: Vec<String> = c
        .cluster()
        .pods(&c.stage_selector("train"))
        .iter()
        .filter_map(|p| p.spec.as_ref()?.node_name.clone())
        .collect();
    nodes.sort();
    nodes.dedup();
    assert_eq!(nodes, ["127.0.0.1", "localhost"], "nodes of the train pods");
}

/// The second kubelet (cluster-node2.sh), stopped again when the case ends.
struct SecondNode<'a>(&'a Case);

impl<'a> SecondNode<'a> {
    fn start(c: &'a Case) -> Self {
        let node = SecondNode(c);
        c.suite.script("cluster.sh", &["start", "kubelet2"]);
        node
    }
}

impl Drop for SecondNode<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.0.suite.try_script("cluster.sh", &["stop", "kubelet2"]) {
            println!("stopping the second kubelet: {e}");
        }
    }
}
