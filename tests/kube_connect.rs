//! Reaching the cluster goes wrong: every command that talks to Kubernetes says what is wrong
//! with the kubeconfig, the credentials or the namespace, the same way and with the same exit
//! code (docs/exit-codes.md), and never shows a token.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mflow_kube::testing::fake_api::FakeApi;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TOKEN: &str = "tok-3f9c2a7e51d84b06a9e7c3d2f1b0a9e8";

/// An API server that answers every request with 401, as one does for a garbage or expired
/// token or the token of a deleted ServiceAccount; keeps the requests' header blocks.
struct Rejecting {
    url: String,
    seen: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Rejecting {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Rejecting {
    async fn start() -> Rejecting {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let kept = seen.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                let kept = kept.clone();
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 8192];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match sock.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    kept.lock().unwrap().push(String::from_utf8_lossy(&head).to_string());
                    let body = r#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"Unauthorized","reason":"Unauthorized","code":401}"#;
                    let reply = format!("HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
                    let _ = sock.write_all(reply.as_bytes()).await;
                    let _ = sock.shutdown().await;
                });
            }
        });
        Rejecting { url, seen, task }
    }
}

/// A kubeconfig of two contexts, `dev` (current, user `alice`, namespace `namespace`) and
/// `staging`, both on `server`.
fn kubeconfig(dir: &Path, server: &str, namespace: &str) -> PathBuf {
    let path = dir.join("kubeconfig");
    let text = format!(
        "apiVersion: v1\nkind: Config\ncurrent-context: dev\nclusters:\n- name: c1\n  cluster:\n    server: {server}\ncontexts:\n- name: dev\n  context:\n    cluster: c1\n    user: alice\n    namespace: {namespace}\n- name: staging\n  context:\n    cluster: c1\n    user: alice\n    namespace: {namespace}\nusers:\n- name: alice\n  user:\n    token: {TOKEN}\n"
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// A kubernetes spec with a local workdir (the engine runs here) and `extra` lines under
/// [pipeline.kubernetes].
fn spec(dir: &Path, extra: &str) -> PathBuf {
    let path = dir.join("spec.toml");
    let text = format!(
        "[pipeline]\nname = \"connect\"\nbackend = \"kubernetes\"\nworkdir = \"{}\"\n\n[pipeline.kubernetes]\nimage = \"ghcr.io/mflow-dev/mflow:0.1.0\"\n{extra}\n\n[stages.one]\nkind = \"command\"\nrun = [\"sh\", \"-c\", \"true\"]\n",
        dir.join("wd").display()
    );
    std::fs::write(&path, text).unwrap();
    path
}

async fn mflow(dir: &Path, kubeconfig: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_mflow"));
    cmd.args(args)
        .env("KUBECONFIG", kubeconfig)
        .env("NO_COLOR", "1")
        .env("HOME", dir)
        .env_remove("MFLOW_PROGRESS")
        .env_remove("RUST_LOG")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .current_dir(dir)
        .kill_on_drop(true);
    for (k, v) in env {
        cmd.env(k, v);
    }
    tokio::time::timeout(Duration::from_secs(60), cmd.output()).await.expect("mflow finished in time").unwrap()
}

/// stderr's words (diagnostics are wrapped to the terminal's width), after checking the exit
/// code and that the token appears nowhere.
fn words_of(o: &Output, code: i32, what: &str) -> String {
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.status.code(), Some(code), "{what}: stdout:\n{out}\nstderr:\n{err}");
    assert!(!out.contains(TOKEN) && !err.contains(TOKEN), "{what} shows the token:\n{out}\n{err}");
    err.replace('│', " ").split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Every command that reaches the cluster, against it.
fn commands(spec: &Path) -> Vec<Vec<String>> {
    let spec = spec.to_str().unwrap();
    [
        vec!["run", spec],
        vec!["run", "--dry-run", spec],
        vec!["runs", "--backend", "kubernetes"],
        vec!["status", "--backend", "kubernetes"],
        vec!["logs", "--backend", "kubernetes", "one"],
        vec!["report", "--backend", "kubernetes"],
        vec!["attach", "20260101-000000-000-aaaa"],
        vec!["cancel", "20260101-000000-000-aaaa"],
    ]
    .into_iter()
    .map(|c| c.into_iter().map(String::from).collect())
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_credentials_are_said_as_such_by_every_command_with_exit_2() {
    let server = Rejecting::start().await;
    let dir = tempfile::tempdir().unwrap();
    let kc = kubeconfig(dir.path(), &server.url, "ml");
    let spec = spec(dir.path(), "");
    for args in commands(&spec) {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let what = args.join(" ");
        let words = words_of(&mflow(dir.path(), &kc, &args, &[]).await, 2, &what);
        assert!(words.contains(&format!("the Kubernetes API server at {}/ rejected the credentials of context \"dev\" (user \"alice\") (HTTP 401: Unauthorized)", server.url)), "{what}: {words}");
        assert!(words.contains("kubectl create token"), "{what}: the way forward is missing: {words}");
        assert!(
            !words.contains("forbidden") && !words.contains("mflow kube rbac"),
            "{what}: rights advice for a rejected credential: {words}"
        );
    }
    assert!(!dir.path().join("wd/runs").exists(), "a run started");
    // The token did reach the server: the test would see a leak if there were one.
    assert!(server
        .seen
        .lock()
        .unwrap()
        .iter()
        .any(|h| h.to_lowercase().contains(&format!("authorization: bearer {}", TOKEN.to_lowercase()))));

    // Not at the most verbose log level either.
    let o = mflow(dir.path(), &kc, &["run", spec.to_str().unwrap()], &[("RUST_LOG", "trace")]).await;
    words_of(&o, 2, "run with RUST_LOG=trace");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubeconfig_mistakes_are_the_users_to_fix() {
    let server = Rejecting::start().await;
    let dir = tempfile::tempdir().unwrap();
    let spec = spec(dir.path(), "");
    let run = ["run", spec.to_str().unwrap()];
    let runs = ["runs", "--backend", "kubernetes"];

    let missing = dir.path().join("no-such-kubeconfig");
    for args in [&run[..], &runs[..]] {
        let words = words_of(&mflow(dir.path(), &missing, args, &[]).await, 2, "a missing kubeconfig");
        assert!(
            words.contains(&format!("cannot read the kubeconfig {}: the file does not exist", missing.display())),
            "{words}"
        );
        assert!(words.contains("KUBECONFIG"), "{words}");
    }

    let broken = dir.path().join("broken-kubeconfig");
    std::fs::write(
        &broken,
        format!("apiVersion: v1\nusers:\n- name: alice\n  user:\n    token: {TOKEN}\n  clusters: [\n"),
    )
    .unwrap();
    for args in [&run[..], &runs[..]] {
        let words = words_of(&mflow(dir.path(), &broken, args, &[]).await, 2, "a kubeconfig of broken YAML");
        assert!(
            words.contains(&format!("cannot read the kubeconfig {}: not a valid kubeconfig (YAML)", broken.display())),
            "{words}"
        );
    }

    let kc = kubeconfig(dir.path(), &server.url, "ml");
    let other = dir.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    let spec = self::spec(&other, "context = \"prod\"");
    let words = words_of(
        &mflow(dir.path(), &kc, &["run", spec.to_str().unwrap()], &[]).await,
        2,
        "an unknown context in the spec",
    );
    assert!(words.contains("the kubeconfig has no context \"prod\" (contexts: dev, staging)"), "{words}");
    let words = words_of(&mflow(dir.path(), &kc, &["runs", "--context", "prod"], &[]).await, 2, "an unknown --context");
    assert!(words.contains("the kubeconfig has no context \"prod\" (contexts: dev, staging)"), "{words}");
    assert!(server.seen.lock().unwrap().is_empty(), "a kubeconfig mistake reached the server");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_namespace_is_said_as_such() {
    let api = FakeApi::start().await;
    for file in ["runtime.yaml", "runtime-cpu.yaml"] {
        let path = format!("{}/examples/kubernetes/{file}", env!("CARGO_MANIFEST_DIR"));
        api.add_runtime(serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap());
    }
    api.add_pvc("ml", "mflow-artifacts");
    let dir = tempfile::tempdir().unwrap();
    let kc = kubeconfig(dir.path(), &api.url(), "nowhere");
    let spec = spec(dir.path(), "");
    for args in [
        vec!["run", spec.to_str().unwrap()],
        vec!["runs", "--backend", "kubernetes"],
        vec!["status", "--backend", "kubernetes"],
        vec!["cancel", "20260101-000000-000-aaaa"],
    ] {
        let what = args.join(" ");
        let words = words_of(&mflow(dir.path(), &kc, &args, &[]).await, 2, &what);
        assert!(
            words.contains(&format!("namespace \"nowhere\" does not exist on the cluster at {}/", api.url())),
            "{what}: {words}"
        );
        assert!(words.contains("kubectl create namespace nowhere"), "{what}: {words}");
        assert!(!words.contains("PersistentVolumeClaim"), "{what}: {words}");
    }
    assert!(!dir.path().join("wd/runs").exists(), "a run started");
    // The same spec in the namespace that exists passes the preflight's namespace check.
    let words = words_of(
        &mflow(dir.path(), &kc, &["runs", "--backend", "kubernetes", "--namespace", "ml"], &[]).await,
        0,
        "runs in ml",
    );
    assert!(words.contains("no runs started outside the cluster in namespace ml"), "{words}");

    let long = format!("team{}", "a".repeat(66));
    let words = words_of(
        &mflow(dir.path(), &kc, &["runs", "--backend", "kubernetes", "--namespace", &long], &[]).await,
        2,
        "a long namespace",
    );
    assert!(
        words.contains(&format!("namespace \"{long}\" is 70 characters long; Kubernetes allows at most 63")),
        "{words}"
    );
}
