//! Real pods on the kubelet: outputs written in pods and read downstream, an OOM kill, images
//! that cannot run, and mflow itself in a pod of the CronJob `mflow schedule render` prints.

use std::path::Path;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::EnvVar;
use mflow_e2e::{secs, wait_until, Case, RunStatus, StageStatus};

use crate::pipeline::{all_stages, message};

fn read(path: impl AsRef<Path>) -> String {
    let path = path.as_ref();
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn output(c: &Case, stage: &str) -> String {
    c.record().stages[stage].output.clone().unwrap_or_else(|| panic!("stage {stage} has no output"))
}

pub fn real_outputs_flow_downstream(c: &Case) {
    let spec = c
        .spec(
            r#"[stages.number]
kind = "command"
run = ["sh", "-c", "echo 21 > $MFLOW_OUTPUT/n.txt"]

[stages.double]
kind = "command"
needs = ["number"]
run = ["sh", "-c", "echo $(( $(cat $MFLOW_INPUT_NUMBER/n.txt) * 2 )) > $MFLOW_OUTPUT/n.txt"]

[stages.model]
kind = "model"
source = "init:llama-tiny"

[stages.convert]
kind = "convert"
model = "${stages.model.output}"
tp = 2
"#,
        )
        .write();
    c.mflow(["run", &spec]).run();
    assert_eq!(read(format!("{}/n.txt", output(c, "double"))).trim(), "42", "the downstream stage's output");
    let model = output(c, "model");
    for file in ["config.json", "model.safetensors"] {
        assert!(Path::new(&model).join(file).is_file(), "the model stage wrote no {file} in {model}");
    }
    let shards = glob::glob(&format!("{}/**/*.safetensors", output(c, "convert"))).expect("a pattern").count();
    assert!(shards > 0, "convert wrote no shards");
    let log = c.attempt_log("number", 1);
    assert!(log.contains("completed"), "attempt log:\n{log}");
    c.mflow(["run", &spec]).run();
    all_stages(&c.record(), StageStatus::Cached);
}

pub fn real_oom_kill(c: &Case) {
    let spec = c
        .spec(
            r#"[stages.greedy]
kind = "command"
resources = { memory = "32Mi" }
run = ["sh", "-c", "dd if=/dev/zero of=/dev/null bs=256M count=4"]
"#,
        )
        .write();
    c.mflow(["run", &spec]).code(1).run();
    let msg = message(&c.record(), "greedy");
    assert!(
        msg.contains("oom: rank 0: container node was killed for exceeding its memory limit (OOMKilled)"),
        "message: {msg}"
    );
}

pub fn missing_and_invalid_images(c: &Case) {
    // An image that no registry can serve (a registry on loopback where nothing listens): the
    // reason is shown while it waits, and the attempt is given up as infra after start_timeout.
    let spec = c
        .spec(
            r#"[stages.missing]
kind = "command"
image = "127.0.0.1:5999/mflow-e2e/not-there:1"
run = ["sh", "-c", "true"]
"#,
        )
        .kube(r#"start_timeout = "30s""#)
        .write();
    c.mflow(["run", &spec]).code(3).run().contains("ErrImagePull");
    let msg = message(&c.record(), "missing");
    assert!(msg.contains("did not start within 30s"), "message: {msg}");
    // A name with a space is no image reference: refused when the spec is read.
    let spec = c
        .spec(
            r#"[stages.invalid]
kind = "command"
image = "Not A/Valid:Image:Name"
run = ["sh", "-c", "true"]
"#,
        )
        .write();
    c.mflow(["run", &spec]).code(2).run().contains("mflow::spec::invalid_value");
    // One only the container runtime can judge (upper case, two tags) fails at once, as the
    // user's error.
    let spec = c
        .spec(
            r#"[stages.invalid]
kind = "command"
image = "Not/Valid:Image:Name"
run = ["sh", "-c", "true"]
"#,
        )
        .write();
    c.mflow(["run", &spec]).code(1).run();
    let msg = message(&c.record(), "invalid");
    assert!(msg.contains("InvalidImageName"), "message: {msg}");
}

/// Applies the objects `mflow schedule render` makes for the spec, adapted to this cluster (the
/// stage image, and the API server on loopback for a host-network pod), and starts a Job named
/// `job` from the CronJob now, as `kubectl create job --from=cronjob/...` does.
fn cron_job(c: &Case, job: &str, spec: &str) {
    let rendered = c.mflow(["schedule", "render", spec, "--namespace", &c.suite.namespace]).run().stdout;
    c.cluster().apply_yaml(&rendered);
    let name = mflow_e2e::Cluster::objects(&rendered)
        .into_iter()
        .find(|o| o.types.as_ref().is_some_and(|t| t.kind == "CronJob"))
        .and_then(|o| o.metadata.name)
        .expect("a CronJob in what `mflow schedule render` prints");
    let mut cron = c.cluster().cronjob(&name);
    let template = cron.spec.job_template.spec.as_mut().expect("a job template");
    let pod = template.template.spec.as_mut().expect("a pod template");
    pod.host_network = Some(true);
    let container = &mut pod.containers[0];
    container.image = Some(mflow_e2e::STAGE_IMAGE.into());
    let env = container.env.get_or_insert_with(Vec::new);
    for (name, value) in [("KUBERNETES_SERVICE_HOST", "127.0.0.1"), ("KUBERNETES_SERVICE_PORT", "6443")] {
        env.push(EnvVar { name: name.into(), value: Some(value.into()), ..EnvVar::default() });
    }
    c.cluster().replace_cronjob(&cron);
    let cron = c.cluster().cronjob(&name);
    let template = cron.spec.job_template.clone();
    let mut meta = template.metadata.unwrap_or_default();
    meta.name = Some(job.into());
    meta.annotations
        .get_or_insert_with(Default::default)
        .insert("cronjob.kubernetes.io/instantiate".into(), "manual".into());
    meta.owner_references = Some(vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
        api_version: "batch/v1".into(),
        kind: "CronJob".into(),
        name: name.clone(),
        uid: cron.metadata.uid.clone().expect("a uid"),
        controller: Some(true),
        ..Default::default()
    }]);
    c.cluster().create_job(&Job { metadata: meta, spec: template.spec, status: None });
}

fn job_condition(c: &Case, job: &str, type_: &str) -> bool {
    let job = c.cluster().job(job);
    let conditions = job.and_then(|j| j.status).and_then(|s| s.conditions).unwrap_or_default();
    conditions.iter().any(|c| c.type_ == type_ && c.status == "True")
}

/// The log of the first pod of a Job.
fn job_log(c: &Case, job: &str, tail: i64) -> String {
    let pods = c.cluster().pods(&format!("job-name={job}"));
    pods.first().and_then(|p| p.metadata.name.clone()).map(|p| c.cluster().pod_log(&p, tail)).unwrap_or_default()
}

const SCHEDULED: &str = r#"[schedule]
cron = "0 3 * * *"

[stages.hello]
kind = "command"
run = ["sh", "-c", "echo hello > $MFLOW_OUTPUT/greeting"]

[stages.shout]
kind = "command"
needs = ["hello"]
run = ["sh", "-c", "tr a-z A-Z < $MFLOW_INPUT_HELLO/greeting > $MFLOW_OUTPUT/greeting"]
"#;

pub fn cronjob_runs_mflow_in_a_pod(c: &Case) {
    let spec = c.spec(SCHEDULED).write();
    cron_job(c, "cron-now", &spec);
    let done = mflow_e2e::wait_for(secs(180), || job_condition(c, "cron-now", "Complete"));
    println!("{}", job_log(c, "cron-now", if done { 20 } else { 80 }));
    assert!(
        done,
        "the Job of the CronJob did not complete in 180s: {:?}",
        c.cluster().job("cron-now").and_then(|j| j.status)
    );
    let dir = c.suite.volume.join("pipelines/mflow-e2e-cronjob-runs-mflow-in-a-pod");
    for file in ["junit.xml", "report.html"] {
        let len = std::fs::metadata(dir.join(file)).map(|m| m.len()).unwrap_or(0);
        assert!(len > 0, "no {file} in {}", dir.display());
    }
    assert_eq!(c.record().status, RunStatus::Succeeded);
    assert_eq!(read(format!("{}/greeting", output(c, "shout"))).trim(), "HELLO");
    assert_eq!(c.trainjobs().len(), 2, "TrainJobs");
}

/// A pod running mflow is deleted (as by a drain or an eviction): mflow, the container's main
/// process, hears SIGTERM, records the run as interrupted, writes its report, and leaves the
/// TrainJob running.
pub fn cronjob_pod_sigterm_detaches(c: &Case) {
    let spec = c
        .spec(
            r#"[schedule]
cron = "0 3 * * *"

[stages.long]
kind = "command"
run = ["sh", "-c", "sleep 3600"]
"#,
        )
        .write();
    cron_job(c, "cron-drain", &spec);
    wait_until(secs(120), "the stage's pod to run", || c.running_pod(None).is_some());
    let pods = c.cluster().pods("job-name=cron-drain");
    let pod = pods.first().and_then(|p| p.metadata.name.clone()).expect("the pod of the Job");
    c.cluster().delete_pod(&pod, None, true);
    println!("{}", job_log(c, "cron-drain", 5));
    let dir = c.suite.volume.join("pipelines/mflow-e2e-cronjob-pod-sigterm-detaches");
    assert_eq!(c.record().status, RunStatus::Interrupted);
    let report = std::fs::metadata(dir.join("report.html")).map(|m| m.len()).unwrap_or(0);
    assert!(report > 0, "no report after SIGTERM in {}", dir.display());
    let jobs = c.trainjobs();
    assert_eq!(jobs.len(), 1, "the TrainJob was left running");
    assert!(!jobs[0].deleting(), "the TrainJob is being deleted");
    c.cluster().delete_trainjobs(&format!("{}={}", mflow_kube::LABEL_PIPELINE, c.pipeline()));
}
