//! TrainJob manifests checked against the real Trainer v2.3 CRD schemas.

mod support;

use std::collections::BTreeMap;

use mflow_kube::{
    is_rfc1035_label, trainjob_manifest, trainjob_name, validate_request, KubeError, KubeOptions, StageRequest,
    MAX_TRAINJOB_NAME,
};
use proptest::prelude::*;
use serde_json::{json, Value};
use support::schema;

pub fn fixture_request(which: &str) -> StageRequest {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/requests.json")).unwrap();
    let all: Value = serde_json::from_str(&text).unwrap();
    let r = &all[which];
    let s = |k: &str| r[k].as_str().unwrap_or_default().to_string();
    let n = |k: &str| r[k].as_u64().unwrap() as u32;
    StageRequest {
        pipeline: s("pipeline"),
        stage: s("stage"),
        key: s("key"),
        attempt: n("attempt"),
        kind: s("kind"),
        image: s("image"),
        command: serde_json::from_value(r["command"].clone()).unwrap(),
        env: serde_json::from_value::<BTreeMap<String, String>>(r["env"].clone()).unwrap(),
        num_nodes: n("num_nodes"),
        nproc_per_node: n("nproc_per_node"),
        gpus_per_node: n("gpus_per_node"),
        cpus: r["cpus"].as_str().map(String::from),
        memory: r["memory"].as_str().map(String::from),
        runtime: s("runtime"),
        workload_digest: r["workload_digest"].as_str().map(String::from),
        timeout: r["timeout_seconds"].as_u64().map(std::time::Duration::from_secs),
    }
}

fn options() -> KubeOptions {
    KubeOptions {
        namespace: Some("ml".into()),
        shm_size: Some("16Gi".into()),
        active_deadline_seconds: Some(86_400),
        service_account: Some("mflow".into()),
        ..KubeOptions::default()
    }
}

fn trainjob_validator() -> jsonschema::Validator {
    schema::crd_validator(&schema::crd("trainer.kubeflow.org_trainjobs.yaml"))
}

#[test]
fn stage_manifests_validate_against_the_trainjob_crd() {
    let validator = trainjob_validator();
    for which in ["train", "convert"] {
        let manifest = trainjob_manifest(&fixture_request(which), &options());
        let errors = schema::violations(&validator, &manifest);
        assert!(errors.is_empty(), "{which}: {errors:#?}");
        let plain = trainjob_manifest(&fixture_request(which), &KubeOptions::default());
        let errors = schema::violations(&validator, &plain);
        assert!(errors.is_empty(), "{which} (default options): {errors:#?}");
    }
}

#[test]
fn the_validator_rejects_what_the_api_server_would() {
    let validator = trainjob_validator();
    let good = trainjob_manifest(&fixture_request("train"), &options());
    let mut typo = good.clone();
    typo["spec"]["trainer"]["imagee"] = json!("x");
    assert!(!schema::violations(&validator, &typo).is_empty(), "unknown field accepted");
    let mut wrong_type = good.clone();
    wrong_type["spec"]["trainer"]["numNodes"] = json!("two");
    assert!(!schema::violations(&validator, &wrong_type).is_empty(), "string numNodes accepted");
    let mut no_runtime = good;
    no_runtime["spec"].as_object_mut().unwrap().remove("runtimeRef");
    assert!(!schema::violations(&validator, &no_runtime).is_empty(), "missing runtimeRef accepted");
}

#[test]
fn upstream_trainjob_examples_validate() {
    let validator = trainjob_validator();
    for file in ["examples/01-multi-node.yaml", "examples/02-runtime-patches.yaml"] {
        let text = std::fs::read_to_string(schema::kubeflow_dir().join(file)).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value = Value::deserialize(doc).unwrap();
            if value["kind"] == "TrainJob" {
                let errors = schema::violations(&validator, &value);
                assert!(errors.is_empty(), "{file}: {errors:#?}");
            }
        }
    }
}

use serde::Deserialize;

fn example(file: &str) -> Value {
    let path = format!("{}/../../examples/kubernetes/{file}", env!("CARGO_MANIFEST_DIR"));
    serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn example_runtimes_validate_against_the_clustertrainingruntime_crd() {
    let validator = schema::crd_validator(&schema::crd("trainer.kubeflow.org_clustertrainingruntimes.yaml"));
    // The GPU runtime (`runtime`) and the CPU runtime (`cpu_runtime`) mflow defaults to.
    for (file, name) in [("runtime.yaml", mflow_kube::DEFAULT_RUNTIME), ("runtime-cpu.yaml", "mflow-cpu")] {
        let runtime = example(file);
        let errors = schema::violations(&validator, &runtime);
        assert!(errors.is_empty(), "{file}: {errors:#?}");
        assert_eq!(runtime["metadata"]["name"], name, "{file}");
        assert_eq!(runtime["kind"], "ClusterTrainingRuntime", "{file}");
        // Fail-fast, so that retries are mflow's; container `node` in replicatedJob `node`,
        // where mflow's runtime patch and Trainer's torch plugin expect them.
        let job = &runtime["spec"]["template"]["spec"]["replicatedJobs"][0];
        assert_eq!(job["name"], "node", "{file}");
        let pod = &job["template"]["spec"];
        assert_eq!(pod["backoffLimit"], 0, "{file}");
        assert_eq!(pod["template"]["spec"]["restartPolicy"], "Never", "{file}");
        assert_eq!(pod["template"]["spec"]["containers"][0]["name"], "node", "{file}");
        // The torch policy injects PET_* (multi-node `command` stages use them too).
        assert!(runtime["spec"]["mlPolicy"]["torch"].is_object(), "{file}");
    }
    let cpu = example("runtime-cpu.yaml");
    let container =
        &cpu["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0];
    assert!(container["resources"]["limits"].get("nvidia.com/gpu").is_none());
    let runtime = example("runtime.yaml");
    // The upstream runtime passes the same check, so the validator is not just permissive.
    let upstream = schema::load_yaml("runtimes/torch_distributed.yaml");
    assert!(schema::violations(&validator, &upstream).is_empty());
    let mut broken = runtime.clone();
    broken["spec"]["mlPolicy"]["numNodes"] = json!("one");
    assert!(!schema::violations(&validator, &broken).is_empty());
}

#[test]
fn manifest_shape() {
    insta::assert_json_snapshot!("train_manifest", trainjob_manifest(&fixture_request("train"), &options()));
    insta::assert_json_snapshot!(
        "convert_manifest",
        trainjob_manifest(&fixture_request("convert"), &KubeOptions::default())
    );
}

#[test]
fn cpu_stages_pin_one_process_per_node() {
    // Without numProcPerNode, Trainer would start one process per requested CPU.
    let manifest = trainjob_manifest(&fixture_request("convert"), &KubeOptions::default());
    assert_eq!(manifest["spec"]["trainer"]["numProcPerNode"], 1);
    assert_eq!(manifest["spec"]["trainer"]["numNodes"], 1);
    assert!(manifest["spec"]["trainer"]["resourcesPerNode"]["limits"].get("nvidia.com/gpu").is_none());
}

/// The kubelet expands `$(NAME)` and `$$` in command, args and env values: what mflow asks
/// for must reach the container as written, whatever variables the pod has.
#[test]
fn dollar_signs_reach_the_container_as_written() {
    let mut req = fixture_request("convert");
    req.command = vec!["sh$".into(), "-c".into(), "echo $$ '$(MFLOW_STAGE)' $ $(".into()];
    req.env.insert("X".into(), "$(MFLOW_STAGE) $$ $".into());
    let manifest = trainjob_manifest(&req, &KubeOptions::default());
    let trainer = &manifest["spec"]["trainer"];
    let env: Vec<(String, String)> = trainer["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap().to_string(), e["value"].as_str().unwrap().to_string()))
        .collect();
    let lookup = |n: &str| env.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let kubelet = |v: &Value| mflow_kube::expand(v.as_str().unwrap(), &lookup);
    let argv: Vec<String> =
        trainer["command"].as_array().unwrap().iter().chain(trainer["args"].as_array().unwrap()).map(kubelet).collect();
    assert_eq!(argv, req.command);
    let x = env.iter().find(|(k, _)| k == "X").unwrap();
    assert_eq!(mflow_kube::expand(&x.1, &lookup), "$(MFLOW_STAGE) $$ $");
    assert_eq!(trainer["args"][1], "echo $$$$ '$$(MFLOW_STAGE)' $$ $$(");
}

#[test]
fn reserved_variables_are_refused_before_submission() {
    let mut req = fixture_request("train");
    req.env.insert("PET_NODE_RANK".into(), "0".into());
    let err = validate_request(&req).unwrap_err();
    assert!(matches!(err, KubeError::ReservedEnv { ref name, .. } if name == "PET_NODE_RANK"), "{err}");
    let manifest = trainjob_manifest(&req, &KubeOptions::default());
    assert!(!manifest.to_string().contains("PET_"));
}

#[test]
fn bad_requests_name_the_field() {
    let mut req = fixture_request("train");
    req.nproc_per_node = 4;
    let err = validate_request(&req).unwrap_err();
    assert!(matches!(err, KubeError::BadRequest { ref field, .. } if field == "nproc_per_node"), "{err}");
    let mut req = fixture_request("convert");
    req.command.clear();
    assert!(matches!(validate_request(&req), Err(KubeError::BadRequest { ref field, .. }) if field == "command"));
}

#[test]
fn long_names_are_shortened_deterministically() {
    let key = "0123456789abcdef0123";
    let name = trainjob_name("a-very-long-pipeline-name-for-llama-finetuning", "evaluate-on-held-out-set", key, 12);
    assert!(name.len() <= MAX_TRAINJOB_NAME && is_rfc1035_label(&name), "{name}");
    assert!(name.ends_with("01234567-a12"), "{name}");
    assert_eq!(
        name,
        trainjob_name("a-very-long-pipeline-name-for-llama-finetuning", "evaluate-on-held-out-set", key, 12)
    );
}

proptest! {
    #[test]
    fn names_are_rfc1035_and_short(pipeline in ".{0,80}", stage in ".{0,80}", key in "[0-9a-f]{8,64}|.{0,20}", attempt in 1u32..100_000) {
        let name = trainjob_name(&pipeline, &stage, &key, attempt);
        prop_assert!(is_rfc1035_label(&name), "{name:?}");
        prop_assert!(name.len() <= MAX_TRAINJOB_NAME, "{name:?}");
        prop_assert_eq!(&name, &trainjob_name(&pipeline, &stage, &key, attempt));
    }

    #[test]
    fn stages_of_one_pipeline_get_distinct_names(pipeline in "[a-z][a-z0-9_-]{0,40}", a in "[a-zA-Z0-9_.-]{1,40}", b in "[a-zA-Z0-9_.-]{1,40}", key in "[0-9a-f]{64}") {
        prop_assume!(a != b);
        prop_assert_ne!(trainjob_name(&pipeline, &a, &key, 1), trainjob_name(&pipeline, &b, &key, 1));
    }

    #[test]
    fn attempts_get_distinct_names(attempt_a in 1u32..1000, attempt_b in 1u32..1000) {
        prop_assume!(attempt_a != attempt_b);
        prop_assert_ne!(trainjob_name("p", "s", "abcdef0123", attempt_a), trainjob_name("p", "s", "abcdef0123", attempt_b));
    }
}

#[test]
fn example_pvc_is_the_default_claim_and_shared() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/kubernetes/pvc.yaml");
    let value: Value = serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let pvc: k8s_openapi::api::core::v1::PersistentVolumeClaim = serde_json::from_value(value).unwrap();
    assert_eq!(pvc.metadata.name.as_deref(), Some(mflow_kube::DEFAULT_PVC));
    assert_eq!(pvc.spec.unwrap().access_modes.unwrap(), ["ReadWriteMany"]);
}
