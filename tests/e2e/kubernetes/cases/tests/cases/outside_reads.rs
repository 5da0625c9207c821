//! From outside the cluster: the runs read as local ones are, the rights a person needs, and
//! what is refused before anything runs (an unbound claim, images that cannot drive a run).

use std::path::Path;
use std::time::Instant;

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use mflow_e2e::{secs, wait_until, Case};

/// From the laptop, the cluster's runs are listed and read as local ones are: runs, status,
/// logs (followed while the stage runs), the HTML report, and an output brought back checked
/// against its digests into a directory that appears whole.
pub fn outside_records_logs_report_download(c: &Case) {
    let spec = c
        .outside_spec(
            r#"[stages.tick]
kind = "command"
run = ["sh", "-c", "for i in 1 2 3 4 5; do echo tick $i; sleep 2; done; echo 5 > $MFLOW_OUTPUT/n"]

[stages.model]
kind = "model"
source = "init:llama-tiny"

# An input already on the volume: hashed by the driver, not sent.
[stages.shared]
kind = "command"
inputs = ["/mflow/e2e/outside-shared.txt"]
run = ["sh", "-c", "cat /mflow/e2e/outside-shared.txt > $MFLOW_OUTPUT/x"]
"#,
        )
        .write();
    let dir = Path::new(&spec).parent().expect("the spec's directory").to_path_buf();
    std::fs::create_dir_all(c.suite.volume.join("e2e")).expect("a directory");
    std::fs::write(c.suite.volume.join("e2e/outside-shared.txt"), "on the volume\n").expect("an input");
    let run = c.mflow(["run", "--detach", &spec]).outside().run().stdout.trim().to_string();
    wait_until(secs(120), "the stage's pod to run", || c.running_pod(Some("tick")).is_some());
    c.mflow(["logs", &run, "tick", "--follow", "--backend", "kubernetes"])
        .outside()
        .timeout(secs(120))
        .run()
        .contains("tick 1")
        .contains("tick 5");
    c.mflow(["attach", &run]).outside().timeout(secs(300)).run();

    c.mflow(["runs", "--backend", "kubernetes"])
        .outside()
        .run()
        .contains(&format!("{run}  succeeded"))
        .contains("ran 3, cached 0  driver succeeded");
    let shared = c.outside_record(&run).stages["shared"].output.clone().unwrap_or_default();
    let x = std::fs::read_to_string(format!("{shared}/x")).unwrap_or_default();
    assert_eq!(x.trim_end(), "on the volume", "the output of the stage reading the volume's input");
    c.mflow(["status", &run, "--backend", "kubernetes"])
        .outside()
        .run()
        .contains(&format!("run {run} ({}) succeeded", c.pipeline()))
        .contains("tick");
    c.mflow(["logs", "tick", "--backend", "kubernetes"]).outside().run().contains("tick 3");
    c.mflow(["status", "no-such-run", "--backend", "kubernetes"])
        .outside()
        .code(2)
        .run()
        .contains("no run no-such-run in namespace ml");

    let report = dir.join("report.html");
    c.mflow(["report", &run, "--backend", "kubernetes", "--out"]).arg(&report).outside().run();
    let html = std::fs::read_to_string(&report).unwrap_or_default();
    assert!(html.contains("<html"), "the report is not HTML");
    assert!(html.contains(&run), "the report does not name the run");
    let partial: Vec<_> = std::fs::read_dir(&dir)
        .expect("the spec's directory")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains("partial"))
        .collect();
    assert!(partial.is_empty(), "a partial report was left: {partial:?}");

    let path = c.mflow(["output", &spec, "model"]).outside().run().last_line().to_string();
    assert!(path.starts_with("/mflow/"), "not a path on the volume: {path}");
    let model = dir.join("model");
    c.mflow(["output", &spec, "model", "--download"])
        .arg(&model)
        .outside()
        .run()
        .contains("each checked against its digest");
    for file in ["model.safetensors", "config.json"] {
        let here = std::fs::read(model.join(file)).unwrap_or_else(|e| panic!("the downloaded {file}: {e}"));
        let there = std::fs::read(Path::new(&path).join(file)).unwrap_or_else(|e| panic!("the volume's {file}: {e}"));
        assert!(here == there, "the downloaded {file} differs from the volume's");
    }
    c.mflow(["output", &spec, "model", "--download"]).arg(&model).outside().code(2).run().contains("exists");
    let small = dir.join("small");
    c.mflow(["output", &spec, "model", "--download"])
        .arg(&small)
        .outside()
        .env("MFLOW_DOWNLOAD_MAX_BYTES", "1000")
        .code(2)
        .run()
        .contains("more than the download bound");
    assert!(!small.exists(), "a refused download left a directory");
}

/// A person gets the rights to run from a laptop from `mflow kube rbac --user`; the engine's
/// rights alone (mflow-user) are stopped by the preflight, which names what is missing.
pub fn outside_rights_of_a_person(c: &Case) {
    let spec = c
        .outside_spec(
            r#"[stages.one]
kind = "command"
run = ["sh", "-c", "echo 1 > $MFLOW_OUTPUT/x"]
"#,
        )
        .write();
    c.mflow(["run", &spec])
        .kubeconfig(c.suite.kubeconfig("mflow-user"))
        .outside()
        .code(3)
        .run()
        .contains("create pods/exec");
    let ns = c.suite.namespace.as_str();
    let rbac = c.mflow(["kube", "rbac", "--namespace", ns, "--user", "mflow-laptop", "--name", "mflow-laptop"]).run();
    c.cluster().apply_yaml(&rbac.stdout);
    let laptop = c.suite.kubeconfig("mflow-laptop");
    c.mflow(["run", &spec]).kubeconfig(&laptop).outside().run().contains("succeeded: 1 ran");
    c.mflow(["runs", "--backend", "kubernetes"]).kubeconfig(&laptop).outside().run().contains("succeeded");
}

/// A claim made where no StorageClass was the default stays Pending for good: the upload pod
/// cannot start, and mflow says why within seconds instead of waiting out its 5 minutes.
pub fn outside_claim_without_storage_class(c: &Case) {
    let pvc: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "mflow-no-class"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }))
    .expect("a claim");
    c.cluster().create_pvc(&pvc);
    let spec = c
        .outside_spec(
            r#"[stages.one]
kind = "command"
run = ["true"]
"#,
        )
        .kube(r#"pvc = "mflow-no-class""#)
        .write();
    let t0 = Instant::now();
    c.mflow(["run", &spec])
        .outside()
        .code(3)
        .run()
        .contains("the claim mflow-no-class is Pending and names no StorageClass");
    assert!(t0.elapsed() < secs(120), "took more than 2 minutes");
    let left: Vec<String> = c
        .cluster()
        .pods("mflow.dev/component=volume")
        .into_iter()
        .filter(|p| {
            let volumes = p.spec.as_ref().and_then(|s| s.volumes.as_ref());
            let claim = volumes.and_then(|v| v.first()?.persistent_volume_claim.as_ref());
            claim.is_some_and(|claim| claim.claim_name == "mflow-no-class")
        })
        .filter_map(|p| p.metadata.name)
        .collect();
    assert!(left.is_empty(), "the volume pod of the unbound claim was left: {left:?}");
    c.cluster().delete_pvc("mflow-no-class");
}

/// The driver runs the image's mflow: an image that cannot be pulled, or one without mflow, is
/// refused before anything is uploaded or started, naming the image.
pub fn outside_images_that_cannot_drive(c: &Case) {
    c.suite.script("image.sh", &["mflow-e2e/plain:dev"]);
    let stages = r#"[stages.one]
kind = "command"
run = ["true"]
"#;
    let spec = c.outside_spec(stages).image("mflow-e2e/plain:dev").write();
    c.mflow(["run", &spec]).outside().code(2).run().contains("the image mflow-e2e/plain:dev has no mflow to run");
    let spec = c.outside_spec(stages).image("127.0.0.1:5999/mflow-e2e/not-there:1").write();
    c.mflow(["run", &spec])
        .outside()
        .timeout(secs(120))
        .code(2)
        .run()
        .contains("the image 127.0.0.1:5999/mflow-e2e/not-there:1 cannot be pulled");
    let drivers = c.cluster().jobs(&format!("mflow.dev/component=driver,mflow.dev/pipeline={}", c.pipeline()));
    assert_eq!(drivers.len(), 0, "drivers started");
}
