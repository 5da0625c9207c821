//! `mflow schedule render`: the CronJob, ServiceAccount, RBAC and ConfigMap, checked by
//! deserializing into k8s-openapi's types (and back: a field the API does not know would be
//! dropped and the round trip would differ).

mod common;

use k8s_openapi::api::batch::v1::CronJob;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use serde::Deserialize;

use common::{code, stderr, stdout, Project};

fn docs(yaml: &str) -> Vec<serde_yaml::Value> {
    serde_yaml::Deserializer::from_str(yaml).map(|d| serde_yaml::Value::deserialize(d).unwrap()).collect()
}

/// Deserializes into `T` and checks that nothing was lost on the way.
fn typed<T: serde::de::DeserializeOwned + serde::Serialize>(doc: &serde_yaml::Value) -> T {
    let t: T = serde_yaml::from_value(doc.clone()).unwrap_or_else(|e| panic!("not a valid object: {e}\n{doc:?}"));
    let back = serde_yaml::to_value(&t).unwrap();
    assert_eq!(&back, doc, "fields unknown to the Kubernetes API");
    t
}

#[test]
fn renders_valid_objects() {
    let p = Project::new(include_str!("fixtures/ci/scheduled.toml"));
    let o = p.mflow(&["schedule", "render", "spec.toml"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let yaml = stdout(&o);
    let docs = docs(&yaml);
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "CronJob"]
    );

    let sa: ServiceAccount = typed(&docs[0]);
    assert_eq!(sa.metadata.name.as_deref(), Some("mflow-nightly"));
    assert_eq!(sa.metadata.namespace.as_deref(), Some("ml"));
    let role: Role = typed(&docs[1]);
    let rules: Vec<(String, String, String)> = role
        .rules
        .unwrap()
        .into_iter()
        .map(|r| (r.api_groups.unwrap().join(","), r.resources.unwrap().join(","), r.verbs.join(",")))
        .collect();
    let rule = |g: &str, r: &str, v: &str| (g.to_string(), r.to_string(), v.to_string());
    assert_eq!(
        rules,
        [
            rule("trainer.kubeflow.org", "trainjobs", "create,get,list,watch,delete"),
            rule("", "pods", "list,watch"),
            rule("", "pods/log", "get"),
            rule("", "events", "list"),
            rule("", "configmaps", "create,get,list,update"),
            rule("", "persistentvolumeclaims", "get"),
        ]
    );
    let rb: RoleBinding = typed(&docs[2]);
    assert_eq!(rb.role_ref.name, "mflow-nightly-gpt-6e31823f");
    assert_eq!(rb.subjects.unwrap()[0].name, "mflow-nightly");
    let cr: ClusterRole = typed(&docs[3]);
    assert_eq!(cr.rules.unwrap()[0].verbs, ["get", "list"], "cluster-wide access is read-only");
    let _: ClusterRoleBinding = typed(&docs[4]);
    let cm: ConfigMap = typed(&docs[5]);
    assert_eq!(cm.data.unwrap()["spec.toml"], include_str!("fixtures/ci/scheduled.toml"));

    let cj: CronJob = typed(&docs[6]);
    let spec = cj.spec;
    assert_eq!(spec.schedule, "0 3 * * *");
    assert_eq!(spec.time_zone.as_deref(), Some("Europe/Berlin"));
    assert_eq!(spec.concurrency_policy.as_deref(), Some("Forbid"));
    assert_eq!(spec.starting_deadline_seconds, Some(1800));
    let pod = spec.job_template.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.service_account_name.as_deref(), Some("mflow-nightly"));
    assert_eq!(pod.containers[0].image.as_deref(), Some("registry.example.com/mflow:0.1.0"));
    let script = &pod.containers[0].command.as_ref().unwrap()[2];
    assert!(script.contains("exec mflow run \"./$PIPELINE_SPEC\" --junit"), "{script}");
    assert!(script.contains("--report"), "{script}");
    let vols = pod.volumes.unwrap();
    assert_eq!(vols[0].persistent_volume_claim.as_ref().unwrap().claim_name, "team-artifacts");
    assert_eq!(vols[1].config_map.as_ref().unwrap().name, "mflow-nightly-gpt-6e31823f-spec");

    insta::assert_snapshot!("ci_schedule_render", yaml);
}

#[test]
fn bad_schedules_are_invalid() {
    for (cron, why) in [
        ("0 3 * *", "4 fields"),
        ("61 * * * *", "minute: `61`"),
        ("*/0 * * * *", "step `0`"),
        ("@sometimes", "unknown descriptor"),
        // what robfig/cron, which the API server checks with, refuses too
        ("0 3 * * 7", "outside 0-6"),
        ("0 5-3 * * *", "the range `5-3`"),
        ("0 3 * FOO *", "not a number or a name"),
    ] {
        let p = Project::new(&include_str!("fixtures/ci/scheduled.toml").replace("0 3 * * *", cron));
        let o = p.mflow(&["schedule", "render", "spec.toml"]);
        assert_eq!(code(&o), 2, "{cron}");
        assert!(stderr(&o).contains(why), "{cron}: {}", stderr(&o));
    }
    let p = Project::new(&include_str!("fixtures/ci/scheduled.toml").replace("Europe/Berlin", "Mars/Olympus"));
    let o = p.mflow(&["schedule", "render", "spec.toml"]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("not an IANA time zone"));
    // The controller loads zones by their exact names.
    let p = Project::new(&include_str!("fixtures/ci/scheduled.toml").replace("Europe/Berlin", "europe/berlin"));
    let o = p.mflow(&["schedule", "render", "spec.toml"]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("case-sensitive: write \"Europe/Berlin\""), "{}", stderr(&o));
    let p = Project::new("[pipeline]\nname = \"x\"\n[stages.a]\nkind = \"command\"\nrun = [\"true\"]\n");
    let o = p.mflow(&["schedule", "render", "spec.toml"]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("no [schedule] section"));
}

/// A Kubernetes API stand-in on 127.0.0.1: records each request's method, path and query and
/// content type, and answers with the object it was sent (as server-side apply does).
fn api_server() -> (u16, std::sync::mpsc::Receiver<(String, String, String)>) {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut request = String::new();
            reader.read_line(&mut request).unwrap();
            let (mut len, mut ctype) = (0usize, String::new());
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                let lower = line.to_ascii_lowercase();
                if let Some(v) = lower.strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap();
                }
                if let Some(v) = lower.strip_prefix("content-type:") {
                    ctype = v.trim().to_string();
                }
            }
            let mut body = vec![0; len];
            reader.read_exact(&mut body).unwrap();
            let mut parts = request.split_whitespace();
            let (method, target) = (parts.next().unwrap_or("").to_string(), parts.next().unwrap_or("").to_string());
            let _ = stream.write_all(format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n", body.len()).as_bytes());
            let _ = stream.write_all(&body);
            let _ = tx.send((method, target, ctype));
        }
    });
    (port, rx)
}

#[test]
fn apply_uses_server_side_apply_for_every_object() {
    let (port, rx) = api_server();
    let p = Project::new(include_str!("fixtures/ci/scheduled.toml"));
    let kubeconfig = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://127.0.0.1:{port}\nusers:\n- name: u\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: u\ncurrent-context: fake\n"
    );
    std::fs::write(p.file("kubeconfig"), kubeconfig).unwrap();
    let o = p.cmd(&["schedule", "apply", "spec.toml"]).env("KUBECONFIG", p.file("kubeconfig")).output().unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let requests: Vec<(String, String, String)> = rx.try_iter().collect();
    let paths: Vec<&str> = requests.iter().map(|(_, t, _)| t.split('?').next().unwrap()).collect();
    assert_eq!(
        paths,
        [
            "/api/v1/namespaces/ml/serviceaccounts/mflow-nightly",
            "/apis/rbac.authorization.k8s.io/v1/namespaces/ml/roles/mflow-nightly-gpt-6e31823f",
            "/apis/rbac.authorization.k8s.io/v1/namespaces/ml/rolebindings/mflow-nightly-gpt-6e31823f",
            "/apis/rbac.authorization.k8s.io/v1/clusterroles/mflow-nightly-gpt-6e31823f-ml",
            "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/mflow-nightly-gpt-6e31823f-ml",
            "/api/v1/namespaces/ml/configmaps/mflow-nightly-gpt-6e31823f-spec",
            "/apis/batch/v1/namespaces/ml/cronjobs/mflow-nightly-gpt-6e31823f",
        ]
    );
    for (method, target, ctype) in &requests {
        assert_eq!(method, "PATCH");
        assert!(target.contains("fieldManager=mflow") && target.contains("force=true"), "{target}");
        assert_eq!(ctype, "application/apply-patch+yaml");
    }
    assert!(stdout(&o).contains("applied cronjob/mflow-nightly-gpt-6e31823f (namespace ml)"), "{}", stdout(&o));
}

/// The CronJob of a rendered schedule.
fn cron_job(p: &Project, spec: &str) -> CronJob {
    let o = p.mflow(&["schedule", "render", spec]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let docs = docs(&stdout(&o));
    typed(docs.iter().find(|d| d["kind"] == "CronJob").unwrap())
}

#[test]
fn a_spec_file_name_is_data_in_the_pods_script_never_shell() {
    let p = Project::new(include_str!("fixtures/ci/scheduled.toml"));
    for name in ["a;touch${IFS}PWNED;.toml", "my nightly spec.toml", "$(touch PWNED).toml", "$(PIPELINE_DIR)$$.toml"] {
        std::fs::copy(p.file("spec.toml"), p.file(name)).unwrap();
        let pod = cron_job(&p, name).spec.job_template.spec.unwrap().template.spec.unwrap();
        let c = &pod.containers[0];
        let env: std::collections::BTreeMap<String, String> =
            c.env.clone().unwrap().into_iter().map(|e| (e.name, e.value.unwrap_or_default())).collect();
        // What the kubelet makes of the value (it expands `$(NAME)` and `$$`): the name as it is.
        assert_eq!(mflow_kube::expand(&env["PIPELINE_SPEC"], &|n| env.get(n).cloned()), name);
        let script = &c.command.as_ref().unwrap()[2];
        assert!(!script.contains(name), "{script}");
        // The script as the pod's shell runs it: the mounts in a scratch directory, and an
        // `mflow` that records its arguments.
        let root = tempfile::tempdir().unwrap();
        let (mount, dir, bin) =
            (root.path().join("etc-mflow"), root.path().join("pipelines/x"), root.path().join("bin"));
        std::fs::create_dir_all(&mount).unwrap();
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::write(mount.join("spec.toml"), "spec").unwrap();
        std::fs::write(bin.join("mflow"), "#!/bin/sh\nfor a in \"$@\"; do echo \"$a\"; done > \"$ARGS\"\n").unwrap();
        std::process::Command::new("chmod").arg("+x").arg(bin.join("mflow")).status().unwrap();
        let status = std::process::Command::new("sh")
            .arg("-c")
            .arg(script.replace("/etc/mflow/", &format!("{}/", mount.display())))
            .current_dir(root.path())
            .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
            .env("PIPELINE_DIR", &dir)
            .env("PIPELINE_SPEC", name)
            .env("ARGS", root.path().join("args"))
            .status()
            .unwrap();
        assert!(status.success(), "{name}: {script}");
        assert_eq!(std::fs::read_to_string(dir.join(name)).unwrap(), "spec", "{name}");
        let args = std::fs::read_to_string(root.path().join("args")).unwrap();
        assert_eq!(args.lines().take(2).collect::<Vec<_>>(), ["run", &format!("./{name}")], "{name}");
        let left: Vec<_> = walk(root.path()).into_iter().filter(|f| f == "PWNED").collect();
        assert!(left.is_empty(), "{name}: the shell ran part of the name: {left:?}");
        assert!(!p.file("PWNED").exists());
    }
}

fn walk(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        if path.is_dir() {
            out.extend(walk(&path));
        }
        out.push(path.file_name().unwrap().to_string_lossy().into_owned());
    }
    out
}

#[test]
fn pipelines_whose_names_differ_get_their_own_objects() {
    let fixture = include_str!("fixtures/ci/scheduled.toml");
    let long = "a".repeat(60);
    let pairs = [("nightly_eval", "Nightly-Eval"), (&*format!("{long}x"), &*format!("{long}y"))];
    for (a, b) in pairs {
        let name = |pipeline: &str| {
            let p = Project::new(&fixture.replace("Nightly_GPT", pipeline));
            let cj = cron_job(&p, "spec.toml");
            let n = cj.metadata.name.unwrap();
            assert!(
                n.len() <= 52 && n.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-'),
                "{n}"
            );
            let env = cj.spec.job_template.spec.unwrap().template.spec.unwrap().containers[0].env.clone().unwrap();
            let dir = env.into_iter().find(|e| e.name == "PIPELINE_DIR").unwrap().value.unwrap();
            (n, dir)
        };
        let (na, da) = name(a);
        let (nb, db) = name(b);
        assert_ne!(na, nb, "{a} and {b}");
        assert_ne!(da, db, "{a} and {b}");
    }
    // A name Kubernetes takes as it is stays as it is.
    let p = Project::new(&fixture.replace("Nightly_GPT", "nightly-gpt"));
    assert_eq!(cron_job(&p, "spec.toml").metadata.name.as_deref(), Some("mflow-nightly-gpt"));
}

#[test]
fn names_kubernetes_refuses_are_refused_at_render() {
    let fixture = include_str!("fixtures/ci/scheduled.toml");
    for (from, to, why) in [
        (
            "service_account = \"mflow-nightly\"",
            "service_account = \"Mflow_Nightly\"",
            "service account \"Mflow_Nightly\"",
        ),
        ("namespace = \"ml\"", "namespace = \"ML team\"", "namespace \"ML team\""),
    ] {
        let p = Project::new(&fixture.replace(from, to));
        let o = p.mflow(&["schedule", "render", "spec.toml"]);
        assert_eq!(code(&o), 2, "{to}: {}", stdout(&o));
        assert!(stderr(&o).contains(why), "{to}: {}", stderr(&o));
    }
    let p = Project::new(fixture);
    let o = p.mflow(&["schedule", "render", "spec.toml", "--namespace", &"n".repeat(64)]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("Kubernetes allows at most 63"), "{}", stderr(&o));
}

/// The scheduled spec lives in a ConfigMap: a webhook URL in it is refused, and `env:NAME`
/// reaches the run from the Secret `[schedule] secret` names.
#[test]
fn a_scheduled_webhook_comes_from_a_secret() {
    let base = include_str!("fixtures/ci/scheduled.toml");
    let with = |notify: &str, secret: &str| {
        base.replace("starting_deadline = \"30m\"", &format!("starting_deadline = \"30m\"\n{secret}"))
            + &format!("\n[notify]\nwebhook = \"{notify}\"\n")
    };
    let p = Project::new(&with("https://hooks.example.com/T0/s3cret", ""));
    let o = p.mflow(&["schedule", "render", "spec.toml"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("stored in a ConfigMap") && !stdout(&o).contains("s3cret"), "{}", stderr(&o));
    p.write_spec(&with("env:MFLOW_WEBHOOK", ""));
    let o = p.mflow(&["schedule", "render", "spec.toml"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("[schedule] secret"), "{}", stderr(&o));
    p.write_spec(&with("env:MFLOW_WEBHOOK", "secret = \"nightly-hooks\""));
    let o = p.mflow(&["schedule", "render", "spec.toml"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let yaml = stdout(&o);
    assert!(yaml.contains("envFrom:") && yaml.contains("secretRef:") && yaml.contains("name: nightly-hooks"), "{yaml}");
    p.write_spec(&with("env:MFLOW_WEBHOOK", "secret = \"Not_A_Name\""));
    assert_eq!(code(&p.mflow(&["validate", "spec.toml"])), 2);
}
