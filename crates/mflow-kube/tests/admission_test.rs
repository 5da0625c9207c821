//! The fake API server admits Trainer's objects as a real v1.35 server with Trainer v2.3 does:
//! strict decoding (400), the CRDs' CEL rules on create and update (422) and Trainer's
//! webhooks (403), each with the real server's words.

mod support;

use axum::http::{Method, Request};
use kube::client::Body;
use kube::Client;
use mflow_kube::testing::structural::Structural;
use serde_json::{json, Value};
use support::fake_api::{FakeApi, FieldValidation};
use support::schema;

const NS: &str = "ml";
const TRAINJOBS: &str = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/ml/trainjobs";
const RUNTIMES: &str = "/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes";

struct Reply {
    code: u16,
    body: Value,
    warnings: Vec<String>,
}

impl Reply {
    fn message(&self) -> &str {
        self.body["message"].as_str().unwrap_or_default()
    }
}

async fn server() -> (FakeApi, Client) {
    let api = FakeApi::start().await;
    api.add_runtime(schema::load_yaml("runtimes/torch_distributed.yaml"));
    let client = Client::try_from(kube::Config::new(api.url().parse().unwrap())).unwrap();
    (api, client)
}

async fn call(client: &Client, method: Method, path: &str, body: &Value) -> Reply {
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(body).unwrap()))
        .unwrap();
    let response = client.send(request).await.unwrap();
    let code = response.status().as_u16();
    let warnings = response.headers().get_all("warning").iter().map(|v| v.to_str().unwrap().to_string()).collect();
    let bytes = response.into_body().collect_bytes().await.unwrap();
    Reply { code, body: serde_json::from_slice(&bytes).unwrap(), warnings }
}

fn trainjob(name: &str) -> Value {
    json!({"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"runtimeRef": {"name": "torch-distributed"},
            "trainer": {"image": "busybox", "command": ["torchrun", "train.py"], "numNodes": 1, "numProcPerNode": 1,
                "env": [{"name": "MFLOW_STAGE", "value": "train"}]},
            "runtimePatches": [{"manager": "mflow.dev/engine", "trainingRuntimeSpec": {"template": {"spec": {
                "replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"spec": {
                    "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]}}}}}]}}}}]}})
}

/// Creates the TrainJob and returns it as stored.
async fn created(client: &Client, job: &Value) -> Value {
    let reply = call(client, Method::POST, TRAINJOBS, job).await;
    assert_eq!(reply.code, 201, "{}", reply.body);
    reply.body
}

#[test]
fn every_rule_of_the_trainer_crds_compiles() {
    let mut counts = Vec::new();
    let mut failures = Vec::new();
    for file in [
        "trainer.kubeflow.org_trainjobs.yaml",
        "trainer.kubeflow.org_trainingruntimes.yaml",
        "trainer.kubeflow.org_clustertrainingruntimes.yaml",
    ] {
        match Structural::compile(&schema::crd(file), "v1alpha1") {
            Ok(s) => counts.push((file, s.rule_count())),
            Err(e) => failures.push(e.to_string()),
        }
    }
    assert!(failures.is_empty(), "rules the fake API server cannot evaluate:\n{}", failures.join("\n"));
    assert_eq!(
        counts,
        [
            ("trainer.kubeflow.org_trainjobs.yaml", 20),
            ("trainer.kubeflow.org_trainingruntimes.yaml", 12),
            ("trainer.kubeflow.org_clustertrainingruntimes.yaml", 12),
        ]
    );
}

#[tokio::test]
async fn cel_rules_refuse_a_trainjob_with_the_servers_words() {
    let (_api, client) = server().await;
    let cases: Vec<(&str, Value, &str)> = vec![
        ("1st-job", trainjob("1st-job"), "<nil>: Invalid value: metadata.name must match RFC 1035 DNS label format"),
        ("nproc", {
            let mut j = trainjob("nproc");
            j["spec"]["trainer"]["numProcPerNode"] = json!(0);
            j
        }, "spec.trainer.numProcPerNode: Invalid value: 0: numProcPerNode must be greater than or equal to 1"),
        ("owner", {
            let mut j = trainjob("owner");
            j["spec"]["managedBy"] = json!("someone.example.com/controller");
            j
        }, "spec.managedBy: Invalid value: \"someone.example.com/controller\": ManagedBy must be trainer.kubeflow.org/trainjob-controller or kueue.x-k8s.io/multikueue if set"),
        ("uri", {
            let mut j = trainjob("uri");
            j["spec"]["initializer"] = json!({"model": {"storageUri": "no-scheme"}});
            j
        }, "spec.initializer.model.storageUri: Invalid value: \"no-scheme\": storageUri may be empty, or it must be a valid URI (scheme://...)"),
    ];
    for (name, job, detail) in cases {
        let reply = call(&client, Method::POST, TRAINJOBS, &job).await;
        assert_eq!((reply.code, reply.body["reason"].as_str()), (422, Some("Invalid")), "{name}: {}", reply.body);
        assert_eq!(reply.message(), format!("TrainJob.trainer.kubeflow.org \"{name}\" is invalid: {detail}"));
        assert_eq!(reply.body["details"]["kind"], "TrainJob");
        assert_eq!(reply.body["details"]["causes"][0]["reason"], "FieldValueInvalid");
    }

    // 64 characters: a DNS subdomain, but over the CRD's label limit.
    let long = "a".repeat(64);
    let reply = call(&client, Method::POST, TRAINJOBS, &trainjob(&long)).await;
    assert_eq!(reply.code, 422);
    assert!(
        reply.message().ends_with("is invalid: <nil>: Invalid value: metadata.name must be no more than 63 characters"),
        "{}",
        reply.message()
    );

    // Not a DNS subdomain: the generic name rule and the CRD's both speak.
    let reply = call(&client, Method::POST, TRAINJOBS, &trainjob("Job_A")).await;
    assert_eq!(reply.code, 422);
    assert!(reply.message().starts_with("TrainJob.trainer.kubeflow.org \"Job_A\" is invalid: [metadata.name: Invalid value: \"Job_A\": a lowercase RFC 1123 subdomain"), "{}", reply.message());
    assert!(
        reply.message().ends_with(", <nil>: Invalid value: metadata.name must match RFC 1035 DNS label format]"),
        "{}",
        reply.message()
    );
}

#[tokio::test]
async fn transition_rules_make_the_trainer_and_the_runtime_ref_immutable() {
    let (api, client) = server().await;
    let stored = created(&client, &trainjob("job-a")).await;
    let path = format!("{TRAINJOBS}/job-a");

    let mut changed = stored.clone();
    changed["spec"]["trainer"]["image"] = json!("busybox:2");
    let reply = call(&client, Method::PUT, &path, &changed).await;
    assert_eq!(reply.code, 422, "{}", reply.body);
    assert_eq!(
        reply.message(),
        "TrainJob.trainer.kubeflow.org \"job-a\" is invalid: spec.trainer: Invalid value: field is immutable"
    );

    let mut moved = stored.clone();
    moved["spec"]["runtimeRef"]["name"] = json!("other");
    let reply = call(&client, Method::PUT, &path, &moved).await;
    assert_eq!(reply.code, 422, "{}", reply.body);
    assert_eq!(
        reply.message(),
        "TrainJob.trainer.kubeflow.org \"job-a\" is invalid: spec.runtimeRef: Invalid value: field is immutable"
    );

    // Suspending is what a TrainJob may change.
    let mut suspended = stored.clone();
    suspended["spec"]["suspend"] = json!(true);
    let reply = call(&client, Method::PUT, &path, &suspended).await;
    assert_eq!(reply.code, 200, "{}", reply.body);
    assert_eq!(api.shared.get("trainjobs", NS, "job-a").unwrap()["spec"]["suspend"], true);

    // The same rules apply to the update of a TrainJob whose trainer was left out on create.
    let mut bare = trainjob("job-b");
    bare["spec"].as_object_mut().unwrap().remove("trainer");
    let stored = created(&client, &bare).await;
    let mut added = stored.clone();
    added["spec"]["trainer"] = json!({"image": "busybox"});
    let reply = call(&client, Method::PUT, &format!("{TRAINJOBS}/job-b"), &added).await;
    assert_eq!(reply.code, 200, "a transition rule ran without an old value: {}", reply.body);
}

#[tokio::test]
async fn unknown_fields_are_a_strict_decoding_error() {
    let (api, client) = server().await;
    let mut job = trainjob("job-a");
    job["spec"]["foo"] = json!(1);
    job["spec"]["trainer"]["env"][0]["colour"] = json!("red");
    job["metadata"]["owner"] = json!("me");
    let strict = "TrainJob in version \"v1alpha1\" cannot be handled as a TrainJob: strict decoding error: unknown field \"spec.foo\", unknown field \"spec.trainer.env[0].colour\", unknown field \"metadata.owner\"";
    for query in ["", "?fieldValidation=Strict"] {
        let reply = call(&client, Method::POST, &format!("{TRAINJOBS}{query}"), &job).await;
        assert_eq!((reply.code, reply.body["reason"].as_str()), (400, Some("BadRequest")), "{query}: {}", reply.body);
        assert_eq!(reply.message(), strict);
    }
    assert!(api.shared.get("trainjobs", NS, "job-a").is_none());

    let reply = call(&client, Method::POST, &format!("{TRAINJOBS}?fieldValidation=Warn"), &job).await;
    assert_eq!(reply.code, 201, "{}", reply.body);
    assert_eq!(
        reply.warnings,
        [
            r#"299 - "unknown field \"spec.foo\"""#,
            r#"299 - "unknown field \"spec.trainer.env[0].colour\"""#,
            r#"299 - "unknown field \"metadata.owner\"""#,
        ]
    );
    let stored = api.shared.get("trainjobs", NS, "job-a").unwrap();
    assert!(stored["spec"].get("foo").is_none() && stored["metadata"].get("owner").is_none(), "{stored}");

    job["metadata"]["name"] = json!("job-b");
    let reply = call(&client, Method::POST, &format!("{TRAINJOBS}?fieldValidation=Ignore"), &job).await;
    assert_eq!((reply.code, reply.warnings.len()), (201, 0), "{}", reply.body);

    let reply = call(&client, Method::POST, &format!("{TRAINJOBS}?fieldValidation=Loud"), &job).await;
    assert_eq!(reply.code, 422);
    assert_eq!(reply.message(), "CreateOptions.meta.k8s.io \"\" is invalid: fieldValidation: Unsupported value: \"Loud\": supported values: \"\", \"Ignore\", \"Strict\", \"Warn\"");

    // Updates decode the same way.
    let mut stored = api.shared.get("trainjobs", NS, "job-b").unwrap();
    stored["spec"]["suspend"] = json!(true);
    stored["spec"]["bar"] = json!(true);
    let reply = call(&client, Method::PUT, &format!("{TRAINJOBS}/job-b"), &stored).await;
    assert_eq!(reply.code, 400, "{}", reply.body);
    assert!(reply.message().ends_with("strict decoding error: unknown field \"spec.bar\""), "{}", reply.message());
}

#[tokio::test]
async fn trainers_webhook_refuses_reserved_variables_and_missing_runtimes_in_its_words() {
    let (_api, client) = server().await;
    let mut job = trainjob("job-a");
    job["spec"]["trainer"]["env"] = json!([{"name": "MFLOW_STAGE", "value": "train"}, {"name": "PET_NNODES", "value": "2"},
        {"name": "PET_MASTER_PORT", "value": "1"}, {"name": "PET_EXTRA", "value": "kept"}]);
    let reply = call(&client, Method::POST, TRAINJOBS, &job).await;
    assert_eq!((reply.code, reply.body["reason"].as_str()), (403, Some("Forbidden")), "{}", reply.body);
    assert_eq!(
        reply.message(),
        r#"admission webhook "validator.trainjob.trainer.kubeflow.org" denied the request: spec.trainer.env: Invalid value: [{"name":"MFLOW_STAGE","value":"train"},{"name":"PET_NNODES","value":"2"},{"name":"PET_MASTER_PORT","value":"1"},{"name":"PET_EXTRA","value":"kept"}]: must not have reserved envs, invalid envs configured: [PET_MASTER_PORT PET_NNODES]"#
    );

    // Only the variables the torch plugin sets are reserved.
    job["spec"]["trainer"]["env"] = json!([{"name": "PET_EXTRA", "value": "kept"}]);
    created(&client, &job).await;

    let mut job = trainjob("job-b");
    job["spec"]["runtimeRef"]["name"] = json!("mflow-torch");
    let reply = call(&client, Method::POST, TRAINJOBS, &job).await;
    assert_eq!(reply.code, 403, "{}", reply.body);
    assert_eq!(
        reply.message(),
        r#"admission webhook "validator.trainjob.trainer.kubeflow.org" denied the request: spec.RuntimeRef: Invalid value: {"name":"mflow-torch","apiGroup":"trainer.kubeflow.org","kind":"ClusterTrainingRuntime"}: clustertrainingruntimes.trainer.kubeflow.org "mflow-torch" not found: specified clusterTrainingRuntime must be created before the TrainJob is created"#
    );

    job["spec"]["runtimeRef"]["kind"] = json!("TrainingRuntime");
    let reply = call(&client, Method::POST, TRAINJOBS, &job).await;
    assert_eq!(reply.code, 403, "{}", reply.body);
    assert!(reply.message().ends_with(r#"denied the request: spec.runtimeRef: Invalid value: {"name":"mflow-torch","apiGroup":"trainer.kubeflow.org","kind":"TrainingRuntime"}: trainingruntimes.trainer.kubeflow.org "mflow-torch" not found: specified trainingRuntime must be created before the TrainJob is created"#), "{}", reply.message());

    job["spec"]["runtimeRef"]["kind"] = json!("JAXRuntime");
    let reply = call(&client, Method::POST, TRAINJOBS, &job).await;
    assert_eq!(reply.code, 403);
    assert!(
        reply.message().ends_with("denied the request: unsupported runtime: JAXRuntime.trainer.kubeflow.org"),
        "{}",
        reply.message()
    );
}

#[tokio::test]
async fn the_server_stores_defaults_and_trainers_patch_times_but_no_status() {
    let (api, client) = server().await;
    let mut job = trainjob("job-a");
    job["status"] = json!({"conditions": [{"type": "Complete", "status": "True"}]});
    let stored = created(&client, &job).await;
    assert_eq!(
        stored["spec"]["runtimeRef"],
        json!({"name": "torch-distributed", "apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime"})
    );
    assert_eq!(stored["spec"]["managedBy"], "trainer.kubeflow.org/trainjob-controller");
    assert_eq!(stored["spec"]["suspend"], false);
    assert_eq!(stored["spec"]["runtimePatches"][0]["time"], "2026-01-01T00:00:00Z");
    assert!(stored.get("status").is_none(), "status written through the main resource: {stored}");

    // The controller's status survives an update of the main resource.
    api.shared.modify("trainjobs", NS, "job-a", |j| j["status"] = json!({"conditions": []}));
    let mut current = api.shared.get("trainjobs", NS, "job-a").unwrap();
    current["spec"]["suspend"] = json!(true);
    current["status"] = json!({"conditions": [{"type": "Failed", "status": "True"}]});
    let reply = call(&client, Method::PUT, &format!("{TRAINJOBS}/job-a"), &current).await;
    assert_eq!(reply.code, 200, "{}", reply.body);
    assert_eq!(reply.body["status"], json!({"conditions": []}));
}

#[tokio::test]
async fn runtimes_are_checked_against_their_crds_rules() {
    let (api, client) = server().await;
    // Every runtime Trainer ships, and mflow's, is admitted as it is.
    for file in ["deepspeed_distributed.yaml", "torch_distributed_with_cache.yaml", "torchtune_llama3_2_1B.yaml"] {
        api.add_runtime(schema::load_yaml(&format!("runtimes/{file}")));
    }
    for file in ["runtime.yaml", "runtime-cpu.yaml"] {
        let path = format!("{}/../../examples/kubernetes/{file}", env!("CARGO_MANIFEST_DIR"));
        let runtime: Value = serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let mut checked = runtime.clone();
        let warnings =
            api.shared.admit("clustertrainingruntimes", "", &mut checked, None, FieldValidation::Warn).unwrap();
        assert!(warnings.is_empty(), "{file}: {warnings:?}");
        api.add_runtime(runtime);
    }

    let mut two = schema::load_yaml("runtimes/torch_distributed.yaml");
    two["metadata"]["name"] = json!("two-policies");
    two["spec"]["mlPolicy"]["mpi"] = json!({"numProcPerNode": 0});
    let reply = call(&client, Method::POST, RUNTIMES, &two).await;
    assert_eq!(reply.code, 422, "{}", reply.body);
    assert_eq!(
        reply.message(),
        "ClusterTrainingRuntime.trainer.kubeflow.org \"two-policies\" is invalid: [spec.mlPolicy: Invalid value: Only one of the policy can be configured, spec.mlPolicy.mpi.numProcPerNode: Invalid value: 0: NumProcPerNode in mpiPolicy must be >= 1]"
    );

    let mut runtime = schema::load_yaml("runtimes/torch_distributed.yaml");
    runtime["metadata"]["name"] = json!("mine");
    runtime["spec"]["template"]["spec"]["failurePolicy"] = json!({"maxRestarts": 0});
    let reply = call(&client, Method::POST, RUNTIMES, &runtime).await;
    assert_eq!(reply.code, 201, "{}", reply.body);
    let mut changed = reply.body.clone();
    changed["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] = json!(3);
    let reply = call(&client, Method::PUT, &format!("{RUNTIMES}/mine"), &changed).await;
    assert_eq!(reply.code, 422, "{}", reply.body);
    assert_eq!(reply.message(), "ClusterTrainingRuntime.trainer.kubeflow.org \"mine\" is invalid: spec.template.spec.failurePolicy: Invalid value: Value is immutable");
}
