//! The kubernetes backend without running stages: the engine choice of `engine = "auto"`, the
//! objects a run would submit rendered offline, and the same objects sent to an in-process API
//! server as a server-side dry run.

use std::path::{Path, PathBuf};

use mflow::backend::kubernetes::render;
use mflow_kube::testing::fake_api::FakeApi;
use mflow_kube::testing::schema;
use serde::Deserialize;
use serde_json::Value;

const NS: &str = "ml";

/// A whole pipeline of CPU stages (the local machine has no GPU to plan a Megatron stage with).
fn pipeline(workdir: &Path, data_resources: &str) -> String {
    format!(
        r#"[pipeline]
name = "kube-render"
backend = "kubernetes"
workdir = "{workdir}"

[pipeline.kubernetes]
namespace = "{NS}"
image = "ghcr.io/mflow-dev/mflow-cpu:0.1.0"
train_image = "ghcr.io/mflow-dev/mflow:0.1.0"

[stages.model]
kind = "model"
source = "init:llama-tiny"

[stages.convert]
kind = "convert"
model = "${{stages.model.output}}"
tp = 2

[stages.data]
kind = "dataset"
inputs = ["corpus.txt"]
tokenizer = "${{stages.model.output}}"
{data_resources}

[stages.train]
kind = "train"
model = "${{stages.convert.output}}"
data = "${{stages.data.output}}"
tp = 2
iterations = 4
seq_length = 32
micro_batch_size = 2
global_batch_size = 4

[stages.export]
kind = "export"
model = "${{stages.train.output}}"

[stages.fanout]
kind = "command"
nodes = 2
run = ["sh", "-c", "echo rank $PET_NODE_RANK > $MFLOW_OUTPUT/rank-$PET_NODE_RANK"]
"#,
        workdir = workdir.display()
    )
}

fn write_spec(dir: &Path, data_resources: &str) -> PathBuf {
    std::fs::write(dir.join("corpus.txt"), "fn main() { println!(\"hello\"); }\n".repeat(50)).unwrap();
    let path = dir.join("spec.toml");
    std::fs::write(&path, pipeline(&dir.join("volume/kube-render"), data_resources)).unwrap();
    path
}

fn plan_of(spec: &Path) -> (mflow::plan::Plan, mflow::cache::Store) {
    let s = mflow::spec::load(spec, &[]).unwrap_or_else(|e| panic!("{:?}", miette::Report::new(e)));
    let env = mflow::env::Environment::detect(None);
    let store = mflow::cache::Store::open(&s.workdir()).unwrap();
    let plan = mflow::plan::build(s, &env).unwrap_or_else(|e| panic!("{:?}", miette::Report::new(e)));
    (plan, store)
}

fn documents(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml).map(|d| Value::deserialize(d).unwrap()).collect()
}

fn env_of(job: &Value) -> Vec<(String, String)> {
    job["spec"]["trainer"]["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap().to_string(), e["value"].as_str().unwrap_or_default().to_string()))
        .collect()
}

#[test]
fn auto_engines_follow_the_gpus_a_stage_requests_on_kubernetes() {
    let dir = tempfile::tempdir().unwrap();
    let spec = dir.path().join("spec.toml");
    let mut text = pipeline(&dir.path().join("volume/kube-render"), "");
    text.push_str(
        r#"
[stages.train_gpu]
kind = "train"
model = "${stages.convert.output}"
data = "${stages.data.output}"
tp = 2
nodes = 2
resources = { gpus = 2 }

[stages.train_pinned]
kind = "train"
model = "${stages.convert.output}"
data = "${stages.data.output}"
engine = "reference"
resources = { gpus = 2 }
"#,
    );
    std::fs::write(&spec, text).unwrap();
    std::fs::write(dir.path().join("corpus.txt"), "some text\n").unwrap();
    let s = mflow::spec::load(&spec, &[]).unwrap_or_else(|e| panic!("{:?}", miette::Report::new(e)));
    let local = mflow::env::Environment::detect(None);
    assert_eq!(mflow::backend::stage_gpus(&s, s.stage("train_gpu").unwrap(), &local), 4, "2 GPUs on each of 2 nodes");
    assert_eq!(mflow::backend::stage_gpus(&s, s.stage("train").unwrap(), &local), 0);
    // The spec stays as written; the plan says which engine runs and why.
    assert_eq!(s.stage("train_gpu").unwrap().params["engine"], "auto", "the loaded spec is unresolved");
    let plan = mflow::plan::build(s, &mflow::env::Environment::detect(None).stages_in_images())
        .unwrap_or_else(|e| panic!("{:?}", miette::Report::new(e)));
    let engine = |stage: &str| plan.stages[plan.index(stage).unwrap()].engine.clone().unwrap();
    assert_eq!(engine("train_gpu").name, "megatron");
    assert_eq!(engine("train_gpu").reason, "kubernetes: resources.gpus x nodes = 4");
    assert_eq!(engine("train").name, "reference");
    assert_eq!(engine("train_pinned").name, "reference", "an explicit engine is kept");

    // On the local backend the machine decides, as before.
    let s = mflow::spec::load_on(&spec, &[], Some(mflow::spec::BackendKind::Local)).unwrap();
    assert_eq!(mflow::backend::stage_gpus(&s, s.stage("train_gpu").unwrap(), &local), local.gpus.len());
}

#[test]
fn a_reshard_stage_inserted_by_planning_runs_as_a_trainjob_too() {
    let dir = tempfile::tempdir().unwrap();
    // Evaluating at TP=1 what trained at TP=2 makes planning insert `evaluate-reshard`.
    let evaluate = "\n[stages.evaluate]\nkind = \"evaluate\"\nmodel = \"${stages.train.output}\"\ndata = \"${stages.data.output}\"\ntp = 1\nseq_length = 32\neval_iters = 2\n";
    let (plan, store) = plan_of(&write_spec(dir.path(), evaluate));
    assert!(plan.index("evaluate-reshard").is_some());
    let yaml = render::render(&plan, &store).unwrap();
    let stages: Vec<String> = documents(&yaml)
        .iter()
        .filter(|d| d["kind"] == "TrainJob")
        .map(|j| j["metadata"]["annotations"]["mflow.dev/stage-name"].as_str().unwrap().to_string())
        .collect();
    assert!(stages.contains(&"evaluate-reshard".to_string()), "{stages:?}");
    assert!(stages.contains(&"evaluate".to_string()), "{stages:?}");
}

#[test]
fn render_prints_every_object_a_run_would_submit() {
    let dir = tempfile::tempdir().unwrap();
    let (plan, store) = plan_of(&write_spec(dir.path(), ""));
    let yaml = render::render(&plan, &store).unwrap();
    let docs = documents(&yaml);
    let validator = schema::crd_validator(&schema::crd("trainer.kubeflow.org_trainjobs.yaml"));

    let workloads = &docs[0];
    assert_eq!(workloads["kind"], "ConfigMap");
    assert_eq!(workloads["immutable"], true);
    assert!(workloads["binaryData"]["mflow_workloads.zip"].as_str().is_some_and(|z| z.len() > 1000));
    let cm_name = workloads["metadata"]["name"].as_str().unwrap();

    let jobs: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "TrainJob").collect();
    let stage = |name: &str| {
        *jobs
            .iter()
            .find(|j| j["metadata"]["annotations"]["mflow.dev/stage-name"] == name)
            .unwrap_or_else(|| panic!("no TrainJob for {name}"))
    };
    assert_eq!(jobs.len(), 6, "{yaml}");
    let mut names = std::collections::BTreeSet::new();
    for job in &jobs {
        let errors = schema::violations(&validator, job);
        assert!(errors.is_empty(), "{errors:#?}\n{job:#}");
        let name = job["metadata"]["name"].as_str().unwrap();
        assert!(mflow_kube::is_rfc1035_label(name) && name.len() <= mflow_kube::MAX_TRAINJOB_NAME, "{name}");
        assert!(names.insert(name.to_string()), "{name} twice");
        assert_eq!(job["metadata"]["namespace"], NS);
        assert!(env_of(job).iter().all(|(k, _)| !k.starts_with("PET_") && k != "CUDA_VISIBLE_DEVICES"), "{job:#}");
        // Outputs are written below the TrainJob's own directory on the volume.
        let output = env_of(job).into_iter().find(|(k, _)| k == "MFLOW_OUTPUT").unwrap().1;
        assert_eq!(output, dir.path().join(format!("volume/kube-render/cache/.kube/{name}/out")).display().to_string());
    }

    let runtime = |j: &Value| j["spec"]["runtimeRef"]["name"].as_str().unwrap().to_string();
    let image = |j: &Value| j["spec"]["trainer"]["image"].as_str().unwrap().to_string();
    let argv = |j: &Value| -> Vec<String> {
        let mut v = vec![j["spec"]["trainer"]["command"][0].as_str().unwrap().to_string()];
        v.extend(
            j["spec"]["trainer"]["args"].as_array().into_iter().flatten().map(|a| a.as_str().unwrap().to_string()),
        );
        v
    };
    for cpu in ["model", "convert", "data"] {
        assert_eq!(runtime(stage(cpu)), "mflow-cpu", "{cpu}");
        assert_eq!(image(stage(cpu)), "ghcr.io/mflow-dev/mflow-cpu:0.1.0", "{cpu}");
        assert_eq!(argv(stage(cpu))[0], "mflow", "{cpu}: native stages run the image's mflow");
    }
    let convert = argv(stage("convert"));
    assert_eq!(convert[1], "convert");
    assert!(convert.iter().any(|a| a == "--tp") && convert.iter().any(|a| a.contains("/.kube/")), "{convert:?}");

    let train = stage("train");
    assert_eq!(runtime(train), "mflow-torch");
    assert_eq!(image(train), "ghcr.io/mflow-dev/mflow:0.1.0");
    let train_argv = argv(train);
    assert_eq!(&train_argv[..3], ["python", "-m", "torch.distributed.run"]);
    assert!(!train_argv.iter().any(|a| a.starts_with("--nnodes") || a.starts_with("--master-addr")), "{train_argv:?}");
    assert!(train_argv.last().unwrap().ends_with("runs/rendered/stages/train/train-config-1.json"), "{train_argv:?}");
    assert_eq!(train["spec"]["trainer"]["numProcPerNode"], 2, "tp = 2 ranks");
    // A CPU stage's request follows its ranks: one core each.
    assert_eq!(train["spec"]["trainer"]["resourcesPerNode"]["requests"]["cpu"], "2", "{train:#}");
    assert!(env_of(train).contains(&("PYTHONPATH".into(), "/opt/mflow/workloads/mflow_workloads.zip".into())));
    let volumes = train["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
        ["template"]["spec"]["template"]["spec"]["volumes"]
        .to_string();
    assert!(volumes.contains(cm_name), "{volumes}");

    // Export with verification needs Python: the train image, both steps in one shell.
    let export = stage("export");
    assert_eq!(image(export), "ghcr.io/mflow-dev/mflow:0.1.0");
    assert_eq!(argv(export)[..2], ["sh", "-c"]);
    let fanout = stage("fanout");
    assert_eq!(fanout["spec"]["trainer"]["numNodes"], 2);
    assert_eq!(runtime(fanout), "mflow-cpu");

    // Keys downstream of outputs not computed yet are provisional, and say so.
    assert!(!yaml.contains("# stage model\n# provisional"), "{yaml}");
    assert!(
        yaml.contains("# stage train\n# provisional key and name: they depend on the output of `convert`"),
        "{yaml}"
    );
    assert!(!dir.path().join("volume/kube-render/runs").exists(), "rendering wrote a run");
}

/// The kubelet expands `$(NAME)` and `$$` in a container's command, args and env values and
/// leaves any other `$`: a stage's `run` and `env`, and the `--set` overrides the driver hands
/// the engine, reach their containers as written, as they do locally.
#[test]
fn dollar_signs_reach_the_containers_as_written() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("corpus.txt"), "some text\n").unwrap();
    let spec = dir.path().join("spec.toml");
    let mut text = pipeline(&dir.path().join("volume/kube-render"), "");
    text.push_str(
        r#"
[stages.dollars]
kind = "command"
run = ["sh", "-c", "echo $$ '$(MFLOW_STAGE)' $ > $MFLOW_OUTPUT/x", "$(HOME)"]
env = { X = "$$ $(MFLOW_STAGE) $", Y = "$(X)" }
"#,
    );
    std::fs::write(&spec, text).unwrap();
    let (plan, store) = plan_of(&spec);
    let objects = render::objects(&plan, &store).unwrap();
    let dollars = objects.stages.iter().find(|s| s.stage == "dollars").unwrap();
    assert_eq!(dollars.request.command[2], "echo $$ '$(MFLOW_STAGE)' $ > $MFLOW_OUTPUT/x", "the request is literal");
    let trainer = &dollars.manifest["spec"]["trainer"];
    assert_eq!(trainer["args"][1], "echo $$$$ '$$(MFLOW_STAGE)' $$ > $$MFLOW_OUTPUT/x");
    // What the kubelet makes of them, with the pod's variables (each env value sees those before it).
    let mut pod: Vec<(String, String)> = Vec::new();
    for (name, value) in env_of(&dollars.manifest) {
        let seen = mflow_kube::expand(&value, &|n| pod.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()));
        pod.push((name, seen));
    }
    let lookup = |n: &str| pod.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()).or(Some("?".into()));
    let argv: Vec<String> = trainer["command"]
        .as_array()
        .unwrap()
        .iter()
        .chain(trainer["args"].as_array().unwrap())
        .map(|a| mflow_kube::expand(a.as_str().unwrap(), &lookup))
        .collect();
    assert_eq!(argv, dollars.request.command);
    let env = |k: &str| pod.iter().find(|(n, _)| n == k).unwrap().1.clone();
    assert_eq!((env("X"), env("Y")), ("$$ $(MFLOW_STAGE) $".to_string(), "$(X)".to_string()));
    assert_eq!(env("MFLOW_STAGE"), "dollars");
    // The yaml a user reads holds the same objects.
    let yaml = render::render(&plan, &store).unwrap();
    assert!(yaml.contains("echo $$$$ '$$(MFLOW_STAGE)' $$ > $$MFLOW_OUTPUT/x"), "{yaml}");

    // The driver of a run from outside the cluster: its `--set` overrides and env likewise.
    let set = "stages.dollars.env.X=$$ $(HOME) $".to_string();
    let driver = mflow_kube::driver::job(&mflow_kube::driver::DriverOptions {
        run: "r1".into(),
        overrides: vec![set.clone()],
        env: [("A".to_string(), "$(B) $$ $".to_string())].into_iter().collect(),
        ..Default::default()
    });
    let c = &driver.spec.unwrap().template.spec.unwrap().containers[0];
    let home = |_: &str| Some("/root".to_string());
    let args: Vec<String> = c.args.iter().flatten().map(|a| mflow_kube::expand(a, &home)).collect();
    assert!(args.windows(2).any(|w| w[0] == "--set" && w[1] == set), "{args:?}");
    let a = c.env.iter().flatten().find(|e| e.name == "A").unwrap();
    assert_eq!(mflow_kube::expand(a.value.as_deref().unwrap(), &home), "$(B) $$ $");
}

#[test]
fn the_shipped_specs_render_with_mflows_own_images() {
    // No images in the spec: mflow's own, of this version.
    let dir = tempfile::tempdir().unwrap();
    let text = pipeline(&dir.path().join("volume/kube-render"), "").replace(
        "image = \"ghcr.io/mflow-dev/mflow-cpu:0.1.0\"\ntrain_image = \"ghcr.io/mflow-dev/mflow:0.1.0\"\n",
        "",
    );
    std::fs::write(dir.path().join("corpus.txt"), "fn main() {}\n".repeat(50)).unwrap();
    let spec = dir.path().join("spec.toml");
    std::fs::write(&spec, text).unwrap();
    let (plan, store) = plan_of(&spec);
    let docs = documents(&render::render(&plan, &store).unwrap());
    let image = |stage: &str| {
        let job = docs.iter().find(|j| j["metadata"]["annotations"]["mflow.dev/stage-name"] == stage).unwrap();
        job["spec"]["trainer"]["image"].as_str().unwrap().to_string()
    };
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(image("convert"), format!("ghcr.io/mflow-dev/mflow-cpu:{version}"));
    assert_eq!(image("train"), format!("ghcr.io/mflow-dev/mflow:{version}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_sends_every_object_and_stores_nothing() {
    let api = FakeApi::start().await;
    for file in ["runtime.yaml", "runtime-cpu.yaml"] {
        let path = format!("{}/examples/kubernetes/{file}", env!("CARGO_MANIFEST_DIR"));
        api.add_runtime(serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap());
    }
    api.add_pvc(NS, "mflow-artifacts");
    let dir = tempfile::tempdir().unwrap();
    // The only test of this binary that reaches a cluster through the environment.
    std::env::set_var("KUBECONFIG", api.kubeconfig(dir.path(), NS));

    let (plan, store) = plan_of(&write_spec(dir.path(), ""));
    let results = render::dry_run(&plan, &store).await.unwrap_or_else(|e| panic!("{:?}", miette::Report::new(e)));
    assert_eq!(results.len(), 7, "the workload ConfigMap and six TrainJobs");
    for r in &results {
        assert!(r.result.is_ok(), "{} {}: {:?}", r.stage, r.name, r.result.as_ref().err().map(|e| e.explain()));
    }
    let posts = |what: &str| api.shared.count_requests(&format!("POST /api{what}"));
    assert_eq!(posts(&format!("s/trainer.kubeflow.org/v1alpha1/namespaces/{NS}/trainjobs")), 6);
    assert_eq!(posts(&format!("/v1/namespaces/{NS}/configmaps")), 1);
    assert!(api.shared.list("trainjobs", NS).is_empty(), "a dry run stored a TrainJob");
    assert!(api.shared.list("configmaps", NS).is_empty(), "a dry run stored a ConfigMap");

    // The server's refusal comes back for the stage it concerns; the others pass. The refusal
    // is a rule of the cluster's own (as a ValidatingAdmissionPolicy says it), which no offline
    // check knows: a TrainJob may not request 512Gi of memory.
    api.shared.inner.lock().unwrap().policies.push(mflow_kube::testing::fake_api::Policy {
        name: "memory-quota".into(),
        message: "a TrainJob may request at most 256Gi of memory per node".into(),
        refuses: |job| job.pointer("/spec/trainer/resourcesPerNode/requests/memory") == Some(&"512Gi".into()),
    });
    let other = tempfile::tempdir().unwrap();
    let (plan, store) = plan_of(&write_spec(other.path(), "resources = { memory = \"512Gi\" }"));
    let results = render::dry_run(&plan, &store).await.unwrap();
    let failed: Vec<&render::DryRun> = results.iter().filter(|r| r.result.is_err()).collect();
    assert_eq!(failed.len(), 1, "{:?}", failed.iter().map(|r| &r.stage).collect::<Vec<_>>());
    assert_eq!(failed[0].stage, "data");
    let why = failed[0].result.as_ref().unwrap_err().explain();
    assert!(
        why.contains("rejected TrainJob") && why.contains("of stage \"data\"") && why.contains("at most 256Gi"),
        "{why}"
    );
}
