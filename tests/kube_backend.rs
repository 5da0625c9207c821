//! `backend = "kubernetes"` end to end: the real binary against an in-process API server and a
//! fake Trainer controller that runs each TrainJob's command on this machine (as if the
//! artifact volume were mounted at the same path in the pods).

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mflow_kube::testing::controller::{self, Scenario};
use mflow_kube::testing::fake_api::FakeApi;
use serde_json::Value;

const NS: &str = "ml";

struct Cluster {
    api: FakeApi,
    dir: tempfile::TempDir,
    kubeconfig: PathBuf,
    _controller: tokio::task::JoinHandle<()>,
}

impl Cluster {
    async fn start() -> Cluster {
        Cluster::start_with(Arc::new(|_: &Value| Scenario::Exec)).await
    }

    async fn start_with(picker: controller::Picker) -> Cluster {
        let api = FakeApi::start().await;
        // The runtimes mflow defaults to, as shipped in examples/kubernetes.
        for file in ["runtime.yaml", "runtime-cpu.yaml"] {
            let path = format!("{}/examples/kubernetes/{file}", env!("CARGO_MANIFEST_DIR"));
            api.add_runtime(serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap());
        }
        api.add_pvc(NS, "mflow-artifacts");
        let controller = controller::spawn(api.shared.clone(), picker);
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = api.kubeconfig(dir.path(), NS);
        Cluster { api, dir, kubeconfig, _controller: controller }
    }

    fn workdir(&self) -> PathBuf {
        self.dir.path().join("volume/kube-demo")
    }

    /// Writes a spec of `stages` whose workdir is on the (stand-in) artifact volume.
    fn spec(&self, name: &str, stages: &str) -> PathBuf {
        let text = format!(
            "[pipeline]\nname = \"kube-demo\"\nbackend = \"kubernetes\"\nworkdir = \"{}\"\n\n[pipeline.kubernetes]\nimage = \"ghcr.io/mflow-dev/mflow:0.1.0\"\n\n{stages}",
            self.workdir().display()
        );
        let path = self.dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    fn command(&self, args: &[&str]) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_mflow"));
        cmd.args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("NO_COLOR", "1")
            .env_remove("MFLOW_PROGRESS")
            .current_dir(self.dir.path())
            .kill_on_drop(true)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        cmd
    }

    async fn mflow(&self, args: &[&str]) -> Output {
        tokio::time::timeout(Duration::from_secs(60), self.command(args).output())
            .await
            .expect("mflow finished in time")
            .unwrap()
    }

    fn trainjobs_created(&self) -> usize {
        self.api.shared.count_requests(&format!("POST /apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS}/trainjobs"))
    }

    fn latest_record(&self) -> Value {
        let runs = self.workdir().join("runs");
        let mut ids: Vec<String> =
            std::fs::read_dir(&runs).unwrap().flatten().map(|e| e.file_name().to_string_lossy().to_string()).collect();
        ids.sort();
        let last = ids.last().expect("a run record");
        serde_json::from_slice(&std::fs::read(runs.join(last).join("run.json")).unwrap()).unwrap()
    }

    /// Waits (30 s at most) until attempt 1's log of `stage` contains `text`.
    async fn wait_for_log(&self, stage: &str, text: &str, failure: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.attempt_log(stage, 1).contains(text) {
            assert!(Instant::now() < deadline, "{failure}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn attempt_log(&self, stage: &str, attempt: u32) -> String {
        let runs = self.workdir().join("runs");
        let Ok(dir) = std::fs::read_dir(&runs) else { return String::new() };
        let mut ids: Vec<String> = dir.flatten().map(|e| e.file_name().to_string_lossy().to_string()).collect();
        ids.sort();
        let Some(last) = ids.last() else { return String::new() };
        std::fs::read_to_string(runs.join(last).join(format!("stages/{stage}/attempt-{attempt}.log")))
            .unwrap_or_default()
    }
}

fn text(o: &Output) -> String {
    format!("stdout:\n{}\nstderr:\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn output_of(record: &Value, stage: &str) -> PathBuf {
    PathBuf::from(
        record["stages"][stage]["output"].as_str().unwrap_or_else(|| panic!("{stage} has an output: {record:#}")),
    )
}

const TWO_STAGES: &str = r#"[stages.hello]
kind = "command"
nodes = 2
run = ["sh", "-c", "echo hello from rank $PET_NODE_RANK of $PET_NNODES; mkdir -p $MFLOW_OUTPUT; echo hi > $MFLOW_OUTPUT/greeting.txt"]

[stages.shout]
kind = "command"
needs = ["hello"]
run = ["sh", "-c", "tr a-z A-Z < $MFLOW_INPUT_HELLO/greeting.txt > $MFLOW_OUTPUT/greeting.txt"]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_runs_as_trainjobs_and_is_cached_locally_and_in_the_cluster() {
    let cluster = Cluster::start().await;
    let spec = cluster.spec("spec.toml", TWO_STAGES);
    let o = cluster.mflow(&["run", spec.to_str().unwrap()]).await;
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(cluster.trainjobs_created(), 2);

    let record = cluster.latest_record();
    assert_eq!(record["stages"]["shout"]["status"], "succeeded");
    assert_eq!(std::fs::read_to_string(output_of(&record, "shout").join("greeting.txt")).unwrap(), "HI\n");
    // Rank 0's output reaches the attempt log with its rank; the other ranks' only when they fail.
    let log = cluster.attempt_log("hello", 1);
    assert!(log.contains("[rank 0] hello from rank 0 of 2"), "{log}");
    assert!(!log.contains("[rank 1]"), "{log}");
    assert!(log.contains("mflow: submitted TrainJob kube-demo-hello-"), "{log}");

    // The cluster's cache index has both outputs.
    let index: Vec<Value> = cluster
        .api
        .shared
        .list("configmaps", NS)
        .into_iter()
        .filter(|c| c["metadata"]["labels"]["mflow.dev/component"] == "cache")
        .collect();
    assert_eq!(index.len(), 2, "{index:#?}");
    let entry: Value = serde_json::from_str(index[0]["data"]["entry.json"].as_str().unwrap()).unwrap();
    assert!(Path::new(entry["output"].as_str().unwrap()).is_dir(), "{entry:#}");

    // Nothing runs again.
    let o = cluster.mflow(&["run", spec.to_str().unwrap()]).await;
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(cluster.trainjobs_created(), 2);
    assert_eq!(cluster.latest_record()["stages"]["hello"]["status"], "cached");

    // Seen from a workdir without those outputs, `plan` reports what the cluster has.
    let elsewhere = cluster.spec("elsewhere.toml", TWO_STAGES).to_str().unwrap().to_string();
    let moved = std::fs::read_to_string(&elsewhere).unwrap().replace("volume/kube-demo", "other/kube-demo");
    std::fs::write(&elsewhere, moved).unwrap();
    let o = cluster.mflow(&["plan", &elsewhere]).await;
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let root = cluster.dir.path().display().to_string();
    let key = record["stages"]["hello"]["key"].as_str().unwrap().to_string();
    insta::with_settings!({filters => vec![(root.as_str(), "[TMP]"), (key.as_str(), "[KEY]")]}, {
        insta::assert_snapshot!("kube_plan_cached_in_cluster", String::from_utf8_lossy(&o.stdout));
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_attempt_is_retried_as_a_new_trainjob() {
    let cluster = Cluster::start().await;
    let spec = cluster.spec(
        "spec.toml",
        r#"[stages.flaky]
kind = "command"
retries = { max = 1, backoff = "10ms", on = ["infra"] }
run = ["sh", "-c", "if [ $MFLOW_ATTEMPT = 1 ]; then echo '{\"class\": \"infra\", \"message\": \"lost the node\"}' > $MFLOW_STATUS; exit 3; fi; echo ok > $MFLOW_OUTPUT/ok"]
"#,
    );
    let o = cluster.mflow(&["run", spec.to_str().unwrap()]).await;
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(cluster.trainjobs_created(), 2);
    let record = cluster.latest_record();
    let attempts = record["stages"]["flaky"]["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{record:#}");
    assert_eq!(attempts[0]["outcome"], "infra");
    assert_eq!(attempts[0]["message"], "lost the node");
    assert_eq!(attempts[1]["outcome"], "success");
    let names: Vec<String> = cluster
        .api
        .shared
        .list("trainjobs", NS)
        .iter()
        .map(|j| j["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    assert!(names.iter().any(|n| n.ends_with("-a2")), "{names:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_failure_names_the_rank_and_exit_code() {
    let cluster = Cluster::start().await;
    let spec = cluster.spec(
        "spec.toml",
        "[stages.broken]\nkind = \"command\"\nrun = [\"sh\", \"-c\", \"echo bad input >&2; exit 7\"]\n",
    );
    let o = cluster.mflow(&["run", spec.to_str().unwrap()]).await;
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let record = cluster.latest_record();
    let message = record["stages"]["broken"]["message"].as_str().unwrap();
    assert_eq!(record["stages"]["broken"]["class"], "user");
    assert!(message.starts_with("rank 0: container node exited with code 7"), "{message}");
    assert!(cluster.attempt_log("broken", 1).contains("[rank 0] bad input"));
}

/// A stage that writes part of its output at once and the rest once `release` exists.
fn held_stage(release: &Path) -> String {
    format!(
        "[stages.long]\nkind = \"command\"\nenv = {{ RELEASE = \"{}\" }}\nrun = [\"sh\", \"-c\", \"echo early > $MFLOW_OUTPUT/early.txt; echo waiting; while [ ! -e $RELEASE ]; do sleep 0.05; done; echo done > $MFLOW_OUTPUT/result.txt\"]\n",
        release.display()
    )
}

impl Cluster {
    /// Starts `mflow run` and kills it once the stage's pod has started.
    async fn run_and_kill_mid_stage(&self, spec: &Path) {
        let mut first = self.command(&["run", spec.to_str().unwrap()]).spawn().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.api.shared.list("pods", NS).is_empty() {
            assert!(Instant::now() < deadline, "no pod started");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        first.kill().await.unwrap();
        let _ = first.wait().await;
        assert_eq!(self.trainjobs_created(), 1);
    }

    fn trainjob_completed(&self) -> bool {
        self.api.shared.list("trainjobs", NS).iter().any(|j| {
            j["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Complete" && c["status"] == "True")
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_mflow_reattaches_instead_of_resubmitting() {
    let cluster = Cluster::start().await;
    let release = cluster.dir.path().join("release");
    let spec = cluster.spec("spec.toml", &held_stage(&release));
    cluster.run_and_kill_mid_stage(&spec).await;

    let second = cluster.command(&["run", spec.to_str().unwrap()]).spawn().unwrap();
    // Release the stage once the second mflow is attached.
    cluster.wait_for_log("long", "reattaching to TrainJob", "the second mflow did not reattach").await;
    std::fs::write(&release, "").unwrap();
    let o = tokio::time::timeout(Duration::from_secs(60), second.wait_with_output()).await.unwrap().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(cluster.trainjobs_created(), 1, "the TrainJob was submitted again");
    let record = cluster.latest_record();
    let output = output_of(&record, "long");
    // What the stage wrote before the restart is committed along with the rest.
    assert_eq!(std::fs::read_to_string(output.join("early.txt")).unwrap(), "early\n");
    assert_eq!(std::fs::read_to_string(output.join("result.txt")).unwrap(), "done\n");
    assert!(output.starts_with(cluster.workdir().join("cache")), "{}", output.display());
    // The TrainJob's own directory is gone once its output is committed.
    let own = cluster.workdir().join("cache/.kube");
    assert_eq!(std::fs::read_dir(&own).map(|d| d.count()).unwrap_or(0), 0, "{}", own.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainjob_that_completed_while_mflow_was_away_is_committed_without_running_again() {
    let cluster = Cluster::start().await;
    let release = cluster.dir.path().join("release");
    let spec = cluster.spec("spec.toml", &held_stage(&release));
    cluster.run_and_kill_mid_stage(&spec).await;
    std::fs::write(&release, "").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cluster.trainjob_completed() {
        assert!(Instant::now() < deadline, "the TrainJob did not complete");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let o = cluster.mflow(&["run", spec.to_str().unwrap()]).await;
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(cluster.trainjobs_created(), 1, "the TrainJob was submitted again");
    let record = cluster.latest_record();
    assert_eq!(record["stages"]["long"]["status"], "succeeded");
    let output = output_of(&record, "long");
    assert_eq!(std::fs::read_to_string(output.join("early.txt")).unwrap(), "early\n");
    assert_eq!(std::fs::read_to_string(output.join("result.txt")).unwrap(), "done\n");
    assert!(cluster.attempt_log("long", 1).contains("already completed"), "{}", cluster.attempt_log("long", 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_permissions_stop_the_run_before_it_starts() {
    let cluster = Cluster::start().await;
    cluster.api.shared.deny("create", "trainjobs");
    let spec = cluster.spec("spec.toml", TWO_STAGES);
    let o = cluster.mflow(&["run", spec.to_str().unwrap()]).await;
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    let words = err.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(words.contains("cannot create trainjobs in namespace \"ml\""), "{err}");
    assert!(words.contains("mflow kube rbac --namespace ml"), "{err}");
    assert!(!err.contains("not-a-real-token"), "{err}");
    assert_eq!(cluster.trainjobs_created(), 0);
    assert!(!cluster.workdir().join("runs").exists(), "a run started");
}

const ONE_STAGE: &str =
    "[stages.hello]\nkind = \"command\"\nrun = [\"sh\", \"-c\", \"echo hi > $MFLOW_OUTPUT/greeting.txt\"]\n";

/// Runs `spec`, expecting it to stop before any TrainJob with `code`; returns stderr.
async fn refused(cluster: &Cluster, spec: &Path, code: i32) -> String {
    let o = cluster.mflow(&["run", spec.to_str().unwrap()]).await;
    assert_eq!(o.status.code(), Some(code), "{}", text(&o));
    assert_eq!(cluster.trainjobs_created(), 0);
    assert!(!cluster.workdir().join("runs").exists(), "a run started");
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!err.contains("not-a-real-token"), "{err}");
    // The diagnostic is wrapped to the terminal's width; compare its words.
    err.replace('│', " ").split_whitespace().collect::<Vec<_>>().join(" ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_cluster_is_reported_before_anything_runs() {
    let cluster = Cluster::start().await;
    let spec = cluster.spec("spec.toml", ONE_STAGE);
    // A kubeconfig naming a port where nothing listens.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let text =
        std::fs::read_to_string(&cluster.kubeconfig).unwrap().replace(&cluster.api.url(), &format!("http://{closed}"));
    std::fs::write(&cluster.kubeconfig, text).unwrap();
    let err = refused(&cluster, &spec, 3).await;
    assert!(err.contains("mflow::kube::unreachable"), "{err}");
    assert!(err.contains("is unreachable") && err.contains(&closed.port().to_string()), "{err}");
    assert!(err.contains("kubectl"), "the way forward is missing: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_runtime_lists_the_runtimes_that_exist() {
    let cluster = Cluster::start().await;
    let spec = cluster.spec("spec.toml", ONE_STAGE);
    let text = std::fs::read_to_string(&spec)
        .unwrap()
        .replace("[pipeline.kubernetes]\n", "[pipeline.kubernetes]\ncpu_runtime = \"mflow-small\"\n");
    std::fs::write(&spec, text).unwrap();
    let err = refused(&cluster, &spec, 3).await;
    assert!(
        err.contains("ClusterTrainingRuntime \"mflow-small\" does not exist (existing: mflow-cpu, mflow-torch)"),
        "{err}"
    );
    assert!(err.contains("examples/kubernetes/runtime.yaml"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_or_old_trainer_crds_say_which_version_is_needed() {
    let cluster = Cluster::start().await;
    let spec = cluster.spec("spec.toml", ONE_STAGE);
    // A v2.1 TrainJob CRD: podTemplateOverrides instead of runtimePatches.
    cluster.api.shared.modify("customresourcedefinitions", "", "trainjobs.trainer.kubeflow.org", |crd| {
        let props = &mut crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
        let patches = props.as_object_mut().unwrap().remove("runtimePatches").unwrap();
        props["podTemplateOverrides"] = patches;
    });
    let err = refused(&cluster, &spec, 3).await;
    assert!(err.contains("mflow::kube::trainer_too_old"), "{err}");
    assert!(err.contains("v2.1") && err.contains("needs v2.2 or newer"), "{err}");

    cluster.api.shared.inner.lock().unwrap().trainer_installed = false;
    let err = refused(&cluster, &spec, 3).await;
    assert!(err.contains("mflow::kube::trainer_missing"), "{err}");
    assert!(err.contains("is not installed") && err.contains("v2.3"), "{err}");
}

/// A rule of the cluster's own, which mflow cannot know before it asks: a TrainJob may not
/// request 512Gi of memory (HTTP 422, as a ValidatingAdmissionPolicy answers).
fn memory_quota() -> mflow_kube::testing::fake_api::Policy {
    mflow_kube::testing::fake_api::Policy {
        name: "memory-quota".into(),
        message: "a TrainJob may request at most 256Gi of memory per node".into(),
        refuses: |job| job.pointer("/spec/trainer/resourcesPerNode/requests/memory") == Some(&"512Gi".into()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_the_server_rejects_fails_its_stage_with_the_servers_message() {
    let cluster = Cluster::start().await;
    cluster.api.shared.inner.lock().unwrap().policies.push(memory_quota());
    let spec = cluster.spec(
        "spec.toml",
        "[stages.bloated]\nkind = \"command\"\nresources = { memory = \"512Gi\" }\nrun = [\"sh\", \"-c\", \"echo hi > $MFLOW_OUTPUT/x\"]\n",
    );
    let o = cluster.mflow(&["run", spec.to_str().unwrap()]).await;
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert_eq!(cluster.trainjobs_created(), 1, "one create call, refused");
    assert!(cluster.api.shared.list("trainjobs", NS).is_empty());
    let record = cluster.latest_record();
    let message = record["stages"]["bloated"]["message"].as_str().unwrap();
    assert!(message.contains("rejected TrainJob") && message.contains("of stage \"bloated\""), "{message}");
    assert!(
        message.contains("denied request") && message.contains("at most 256Gi"),
        "the server's message is missing: {message}"
    );
    assert!(message.contains("help: "), "the way forward is missing: {message}");
}

/// The kubelet expands `$(NAME)` and `$$` in a container's command, args and env values: a
/// stage's arguments and environment still reach it as written, as they do locally (the cache
/// key is the same on both backends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dollar_signs_reach_the_stage_as_written() {
    let cluster = Cluster::start().await;
    let spec = cluster.spec(
        "spec.toml",
        r#"[stages.dollars]
kind = "command"
env = { X = "$$ $(MFLOW_STAGE) $" }
run = ["sh", "-c", "printf '%s|%s|%s' \"$1\" \"$2\" \"$X\" > \"$MFLOW_OUTPUT/seen\"", "sh", "$$", "$(MFLOW_STAGE)"]
"#,
    );
    let o = cluster.mflow(&["run", spec.to_str().unwrap()]).await;
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let seen = std::fs::read_to_string(output_of(&cluster.latest_record(), "dollars").join("seen")).unwrap();
    assert_eq!(seen, "$$|$(MFLOW_STAGE)|$$ $(MFLOW_STAGE) $");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn render_prints_the_trainjobs_without_a_cluster() {
    let cluster = Cluster::start().await;
    let spec = cluster.spec("spec.toml", TWO_STAGES);
    // No cluster at all: a kubeconfig pointing nowhere must not matter.
    let o = cluster.mflow(&["render", spec.to_str().unwrap()]).await;
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let yaml = String::from_utf8_lossy(&o.stdout);
    let docs: Vec<Value> = serde_yaml::Deserializer::from_str(&yaml)
        .map(|d| serde_yaml::with::singleton_map_recursive::deserialize(d).unwrap())
        .collect();
    let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    assert_eq!(kinds.iter().filter(|k| **k == "TrainJob").count(), 2, "{yaml}");
    assert_eq!(cluster.trainjobs_created(), 0);

    let o = cluster.mflow(&["render", spec.to_str().unwrap(), "--backend", "local"]).await;
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("only the kubernetes backend has objects to render"), "{}", text(&o));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_submits_nothing_and_reports_each_stage() {
    let cluster = Cluster::start().await;
    let spec = cluster.spec("spec.toml", TWO_STAGES);
    let o = cluster.mflow(&["run", "--dry-run", spec.to_str().unwrap()]).await;
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("(stage hello): accepted (server-side dry run)"), "{out}");
    assert!(out.contains("(stage shout): accepted (server-side dry run)"), "{out}");
    assert!(cluster.api.shared.list("trainjobs", NS).is_empty(), "a dry run stores nothing");

    cluster.api.shared.inner.lock().unwrap().policies.push(memory_quota());
    let bad = cluster.spec(
        "bad.toml",
        "[stages.bloated]\nkind = \"command\"\nresources = { memory = \"512Gi\" }\nrun = [\"true\"]\n",
    );
    let o = cluster.mflow(&["run", "--dry-run", bad.to_str().unwrap()]).await;
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("(stage bloated): rejected"), "{}", text(&o));
}

impl Cluster {
    /// Starts `mflow run` and sends it `signal` once the stage's pod has started and its first
    /// line was shown; returns what mflow printed and its exit code.
    async fn run_and_signal(&self, spec: &Path, signal: i32) -> Output {
        let child = self.command(&["run", spec.to_str().unwrap()]).spawn().unwrap();
        let pid = child.id().unwrap() as i32;
        self.wait_for_log("long", "waiting", "the stage did not start").await;
        // SAFETY: signalling a child this test started.
        unsafe { libc::kill(pid, signal) };
        tokio::time::timeout(Duration::from_secs(30), child.wait_with_output()).await.expect("mflow stopped").unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_leaves_the_trainjob_running_and_the_next_run_reattaches() {
    let cluster = Cluster::start().await;
    let release = cluster.dir.path().join("release");
    let spec = cluster.spec("spec.toml", &held_stage(&release));
    let o = cluster.run_and_signal(&spec, libc::SIGTERM).await;
    assert_eq!(o.status.code(), Some(143), "{}", text(&o));
    assert!(text(&o).contains("left running"), "{}", text(&o));
    let record = cluster.latest_record();
    assert_eq!(record["status"], "interrupted", "{record:#}");
    assert_eq!(record["stages"]["long"]["status"], "interrupted", "{record:#}");
    assert_eq!(cluster.api.shared.list("trainjobs", NS).len(), 1, "the TrainJob was deleted");

    // The next run reattaches; the line shown before the interruption is not shown again but
    // is in the new attempt log.
    let second = cluster.command(&["run", spec.to_str().unwrap()]).spawn().unwrap();
    cluster.wait_for_log("long", "reattaching to TrainJob", "the second mflow did not reattach").await;
    std::fs::write(&release, "").unwrap();
    let o = tokio::time::timeout(Duration::from_secs(60), second.wait_with_output()).await.unwrap().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(cluster.trainjobs_created(), 1, "the TrainJob was submitted again");
    assert!(!text(&o).contains("[rank 0] waiting"), "a line shown before the restart was shown again: {}", text(&o));
    assert!(cluster.attempt_log("long", 1).contains("[rank 0] waiting"), "{}", cluster.attempt_log("long", 1));
    let output = output_of(&cluster.latest_record(), "long");
    assert_eq!(std::fs::read_to_string(output.join("result.txt")).unwrap(), "done\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_cancels_the_run_and_deletes_its_trainjob() {
    let cluster = Cluster::start().await;
    let release = cluster.dir.path().join("release");
    let spec = cluster.spec("spec.toml", &held_stage(&release));
    let o = cluster.run_and_signal(&spec, libc::SIGINT).await;
    assert_eq!(o.status.code(), Some(130), "{}", text(&o));
    assert_eq!(cluster.latest_record()["status"], "cancelled");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cluster.api.shared.list("trainjobs", NS).is_empty() {
        assert!(Instant::now() < deadline, "the TrainJob was not deleted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn render_and_plan_write_nothing_to_the_workdir() {
    let cluster = Cluster::start().await;
    // An input, so that planning has stats it could save.
    std::fs::write(cluster.dir.path().join("input.txt"), "data").unwrap();
    let spec = cluster.spec("spec.toml", &TWO_STAGES.replace("nodes = 2\n", "nodes = 2\ninputs = [\"input.txt\"]\n"));
    for args in [vec!["render", spec.to_str().unwrap()], vec!["plan", spec.to_str().unwrap()]] {
        let o = cluster.mflow(&args).await;
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        assert!(!cluster.workdir().exists(), "`mflow {}` created {}", args[0], cluster.workdir().display());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_rbac_is_what_mflow_kube_rbac_renders_and_what_the_preflight_checks() {
    let cluster = Cluster::start().await;
    let o = cluster.mflow(&["kube", "rbac", "--namespace", "ml"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let shipped =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/kubernetes/rbac.yaml")).unwrap();
    let rendered = String::from_utf8_lossy(&o.stdout);
    let body = |s: &str| s.lines().skip_while(|l| l.starts_with('#')).collect::<Vec<_>>().join("\n");
    assert_eq!(
        body(&shipped),
        body(&rendered),
        "examples/kubernetes/rbac.yaml differs from `mflow kube rbac --namespace ml`"
    );

    // The fake server enforces exactly those rules: the preflight passes, and without one of
    // them it names what is missing and how to grant it in this namespace.
    let rules: Vec<(String, String)> = mflow_kube::rbac::RULES
        .iter()
        .flat_map(|r| r.verbs.iter().map(|v| (v.to_string(), r.resource.to_string())))
        .collect();
    cluster.api.shared.inner.lock().unwrap().allowed = Some(rules.iter().cloned().collect());
    let spec = cluster.spec("spec.toml", ONE_STAGE);
    let o = cluster.mflow(&["run", spec.to_str().unwrap()]).await;
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    cluster.api.shared.inner.lock().unwrap().allowed =
        Some(rules.into_iter().filter(|(v, r)| !(v == "list" && r == "events")).collect());
    let spec = cluster.spec("other.toml", &ONE_STAGE.replace("hi", "ho"));
    let o = cluster.mflow(&["run", spec.to_str().unwrap()]).await;
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr).replace('│', " ").split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(err.contains("cannot list events in namespace \"ml\""), "{err}");
    assert!(err.contains("mflow kube rbac --namespace ml"), "{err}");
}

/// A train stage on the cluster runs the image's `python`: mflow provisions no interpreter
/// here (the driver's image may have none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_stages_on_the_cluster_need_no_python_here() {
    let cluster = Cluster::start_with(Arc::new(|_: &Value| Scenario::Succeed)).await;
    for d in ["shards", "data"] {
        std::fs::create_dir_all(cluster.dir.path().join(d)).unwrap();
        std::fs::write(cluster.dir.path().join(d).join("stand-in"), d).unwrap();
    }
    let spec = cluster.spec(
        "spec.toml",
        "[stages.train]\nkind = \"train\"\nmodel = \"shards\"\ndata = \"data\"\ntp = 2\niterations = 1\n",
    );
    let home = cluster.dir.path().join("home");
    let mut cmd = cluster.command(&["run", spec.to_str().unwrap()]);
    cmd.env("MFLOW_HOME", &home).env_remove("MFLOW_PYTHON").env("PATH", "/nonexistent");
    let o = tokio::time::timeout(Duration::from_secs(60), cmd.output()).await.unwrap().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(!home.join("python").exists(), "an interpreter was provisioned");
    let jobs = cluster.api.shared.list("trainjobs", NS);
    let trainer = &jobs[0]["spec"]["trainer"];
    assert_eq!(trainer["command"], serde_json::json!(["python"]), "{trainer}");
    assert_eq!(trainer["args"][0], "-m", "{trainer}");
    assert_eq!(trainer["args"][1], "torch.distributed.run", "{trainer}");
}
