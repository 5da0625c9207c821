//! Pipelines of command stages on kwok: submitted, run, cached, failed, retried, timed out; and
//! every spec of the repository checked by the real API server and admission webhooks.

use mflow_e2e::{Case, RunRecord, StageStatus};
use mflow_kube::{LABEL_COMPONENT, LABEL_PIPELINE};

/// Four stages, one of them on two nodes.
pub const DIAMOND: &str = r#"[stages.prep]
kind = "command"
run = ["sh", "-c", "echo prep > $MFLOW_OUTPUT/x"]

[stages.left]
kind = "command"
needs = ["prep"]
run = ["sh", "-c", "cat $MFLOW_INPUT_PREP/x > $MFLOW_OUTPUT/x"]

[stages.right]
kind = "command"
needs = ["prep"]
nodes = 2
run = ["sh", "-c", "tr a-z A-Z < $MFLOW_INPUT_PREP/x > $MFLOW_OUTPUT/x"]

[stages.join]
kind = "command"
needs = ["left", "right"]
run = ["sh", "-c", "cat $MFLOW_INPUT_LEFT/x $MFLOW_INPUT_RIGHT/x > $MFLOW_OUTPUT/x"]
"#;

/// Asserts that the record has stages and that every one of them has `status`.
pub fn all_stages(rec: &RunRecord, status: StageStatus) {
    assert!(!rec.stages.is_empty(), "the run {} has no stages", rec.id);
    for (name, stage) in &rec.stages {
        assert_eq!(stage.status, status, "status of stage {name} in run {}", rec.id);
    }
}

/// The outcomes of a stage's attempts, in order ("user", "success", ...).
pub fn outcomes(rec: &RunRecord, stage: &str) -> Vec<&'static str> {
    rec.stages[stage].attempts.iter().map(|a| a.outcome.map_or("", |o| o.as_str())).collect()
}

/// Why a stage failed, in the words the console uses: `class: message`.
pub fn message(rec: &RunRecord, stage: &str) -> String {
    rec.stages[stage].failure().unwrap_or_default()
}

/// Every spec in the repository, rendered, passes the real API server's strict validation and
/// Trainer's and JobSet's admission webhooks; `mflow run --dry-run` says the same.
pub fn dry_run_every_spec(c: &Case) {
    let mut specs: Vec<_> = ["specs/*.toml", "specs/examples/*.toml"]
        .iter()
        .flat_map(|p| glob::glob(&c.suite.repo.join(p).display().to_string()).expect("a pattern"))
        .flatten()
        .collect();
    specs.sort();
    let mut checked = 0;
    for spec in specs {
        let spec = spec.display().to_string();
        // A Hub source is resolved over the network at plan time; there is none here.
        if std::fs::read_to_string(&spec).expect("a spec").contains("hf://") {
            println!("skipped (needs the Hub): {spec}");
            continue;
        }
        println!("== {spec}");
        let rendered = c.mflow(["render", &spec, "--backend", "kubernetes"]).run().stdout;
        println!("{} TrainJobs", rendered.lines().filter(|l| *l == "kind: TrainJob").count());
        let refused: Vec<String> = c.cluster().dry_run_yaml(&rendered).into_iter().filter_map(Result::err).collect();
        assert!(refused.is_empty(), "the API server refused objects of {spec}:\n{}", refused.join("\n"));
        c.mflow(["run", "--dry-run", &spec, "--backend", "kubernetes"])
            .run()
            .not_contains("rejected")
            .contains("accepted (server-side dry run)");
        checked += 1;
    }
    assert!(checked >= 2, "only {checked} specs checked");
}

pub fn pipeline_runs_and_is_cached(c: &Case) {
    let spec = c.spec(DIAMOND).write();
    c.mflow(["run", &spec]).run();
    let jobs = c.trainjobs();
    assert_eq!(jobs.len(), 4, "TrainJobs");
    assert_eq!(jobs.iter().filter(|j| j.condition("Complete")).count(), 4, "Complete TrainJobs");
    let rec = c.record();
    all_stages(&rec, StageStatus::Succeeded);
    for stage in ["prep", "left", "right", "join"] {
        let out = rec.stages[stage].output.clone().unwrap_or_default();
        assert!(std::path::Path::new(&out).is_dir(), "no committed output for {stage}: {out}");
    }
    let cache = c.cluster().configmaps(&format!("{LABEL_COMPONENT}=cache,{LABEL_PIPELINE}={}", c.pipeline()));
    assert_eq!(cache.len(), 4, "cache index entries");
    // The 2-node stage is one TrainJob of numNodes 2.
    let right = c.cluster().trainjobs(&c.stage_selector("right"));
    assert_eq!(right[0].trainer().num_nodes, Some(2), "numNodes of the 2-node stage");
    // Again: nothing is submitted.
    c.mflow(["run", &spec]).run();
    assert_eq!(c.trainjobs().len(), 4, "TrainJobs after the cached run");
    all_stages(&c.record(), StageStatus::Cached);
}

pub fn failing_stage(c: &Case) {
    let spec = c
        .spec(
            r#"[stages.broken]
kind = "command"
env = { MFLOW_E2E_FAIL = "always" }
run = ["sh", "-c", "exit 1"]
"#,
        )
        .write();
    let out = c.mflow(["run", &spec]).code(1).run();
    let msg = message(&c.record(), "broken");
    assert!(msg.contains("user: rank 0: container node exited with code 1"), "message: {msg}");
    out.not_contains("failed (User)");
}

pub fn flaky_stage_is_retried(c: &Case) {
    let spec = c
        .spec(
            r#"[stages.flaky]
kind = "command"
env = { MFLOW_E2E_FAIL = "first" }
retries = { max = 1, backoff = "1s", on = ["user"] }
run = ["sh", "-c", "true"]
"#,
        )
        .write();
    c.mflow(["run", &spec]).run();
    assert_eq!(outcomes(&c.record(), "flaky"), ["user", "success"]);
    let names: Vec<String> = c.trainjobs().iter().map(|j| j.name().to_string()).collect();
    assert!(names.iter().any(|n| n.ends_with("-a2")), "no TrainJob of attempt 2 among {names:?}");
}

pub fn timeout_is_a_timeout(c: &Case) {
    let spec = c
        .spec(
            r#"[stages.hangs]
kind = "command"
timeout = "5s"
env = { MFLOW_E2E_HANG = "true" }
run = ["sh", "-c", "sleep 1000"]
"#,
        )
        .write();
    c.mflow(["run", &spec]).code(3).run();
    let msg = message(&c.record(), "hangs");
    assert!(msg.contains("timeout: "), "message: {msg}");
    assert_eq!(msg.matches("exceeded its active deadline").count(), 1, "the deadline is said once: {msg}");
}

pub fn foreign_object_is_left_alone(c: &Case) {
    let spec = c
        .spec(
            r#"[stages.taken]
kind = "command"
run = ["sh", "-c", "true"]
"#,
        )
        .write();
    let rendered = c.mflow(["render", &spec]).run().stdout;
    let name = mflow_e2e::Cluster::objects(&rendered)
        .into_iter()
        .find(|o| o.types.as_ref().is_some_and(|t| t.kind == "TrainJob"))
        .and_then(|o| o.metadata.name)
        .expect("a TrainJob in the rendered objects");
    c.cluster().create_trainjob(serde_json::json!({
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name, "labels": {"owner": "someone-else"}},
        "spec": {"runtimeRef": {"name": c.suite.cpu_runtime}, "suspend": true},
    }));
    c.mflow(["run", &spec]).code(1).run();
    let msg = message(&c.record(), "taken");
    assert!(msg.contains("was not created by mflow"), "message: {msg}");
    assert!(!msg.contains("Some(\""), "message: {msg}");
    let job = c.cluster().trainjob(&name).expect("the foreign TrainJob");
    assert_eq!(job.label("owner"), Some("someone-else"), "the foreign TrainJob was changed");
    c.cluster().delete_trainjob(&name);
}

/// A train stage on 2 nodes is one TrainJob of numNodes 2: its tp x pp x dp = 4 ranks split 2
/// per node, each node asks for a core per rank, and torchrun takes the rendezvous from the
/// PET_* variables that Trainer gives each node's pod.
pub fn train_on_two_nodes(c: &Case) {
    // The image has its own Python: the local one only enters the key, and naming it spares
    // provisioning the workloads' environment here.
    let spec = c
        .spec(
            r#"[env]
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
engine = "reference"
tp = 2
pp = 2
nodes = 2
micro_batch_size = 4
global_batch_size = 8
"#,
        )
        .kube(&format!("train_image = \"{}\"", c.suite.image))
        .write();
    let rendered = c.mflow(["render", &spec]).run().stdout;
    let train = rendered.find("mflow.dev/stage-name: train").map(|at| &rendered[at..]).expect("the train TrainJob");
    assert!(train.contains("numNodes: 2"), "rendered:\n{train}");
    assert!(train.contains("numProcPerNode: 2"), "rendered:\n{train}");
    // torchrun gets no topology of its own on the cluster: it is Trainer's.
    assert!(!train.contains("--nproc-per-node"), "rendered:\n{train}");
    c.mflow(["run", &spec]).run();
    let job = &c.cluster().trainjobs(&c.stage_selector("train"))[0];
    assert_eq!(job.trainer().num_nodes, Some(2), "numNodes");
    assert_eq!(job.trainer().num_proc_per_node, Some(2), "numProcPerNode");
    assert_eq!(job.cpus_per_node().as_deref(), Some("2"), "CPU request per node");
    assert_eq!(c.record().stages["train"].status, StageStatus::Succeeded);
    // One pod per node, each told the whole topology by Trainer.
    let pods = c.cluster().pods(&c.stage_selector("train"));
    assert_eq!(pods.len(), 2, "train pods");
    for pod in &pods {
        assert_eq!(mflow_e2e::pod_env(pod, "PET_NNODES").as_deref(), Some("2"), "PET_NNODES");
        assert_eq!(mflow_e2e::pod_env(pod, "PET_NPROC_PER_NODE").as_deref(), Some("2"), "PET_NPROC_PER_NODE");
    }
}
