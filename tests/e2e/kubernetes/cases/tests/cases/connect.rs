//! Reaching the cluster: rejected credentials, an untrusted server certificate, a namespace
//! that does not exist or whose name is too long.

use std::path::Path;
use std::process::Command;

use mflow_e2e::{secs, wait_until, Case, Cluster};

const CONNECT_STAGE: &str = r#"[stages.one]
kind = "command"
run = ["sh", "-c", "true"]
"#;

/// A copy of the admin's kubeconfig with the value of its `KEY:` line replaced.
fn admin_kubeconfig_with(c: &Case, key: &str, value: &str, to: &Path) {
    let admin = std::fs::read_to_string(c.suite.kubeconfig("admin")).expect("the admin's kubeconfig");
    let prefix = format!("    {key}:");
    let text: Vec<String> =
        admin.lines().map(|l| if l.starts_with(&prefix) { format!("{prefix} {value}") } else { l.into() }).collect();
    std::fs::write(to, text.join("\n") + "\n").expect("writing a kubeconfig");
}

/// The value of a kubeconfig's `    token:` line.
fn token_of(kubeconfig: &Path) -> String {
    let text = std::fs::read_to_string(kubeconfig).expect("a kubeconfig");
    let token = text.lines().find_map(|l| l.strip_prefix("    token: ")).unwrap_or("").trim().to_string();
    assert!(!token.is_empty(), "no token in {}", kubeconfig.display());
    token
}

/// Every command that reaches the cluster says the same, with exit 2: `mflow run` (its
/// preflight), `run --dry-run`, and `runs` and `status` as for runs started outside the cluster:
/// the credentials of the context and user were rejected, the token is never shown, and this is
/// not taken for missing rights.
fn rejected_everywhere(c: &Case, kubeconfig: &Path, token: &str, user: &str, spec: &str) {
    let commands: [&[&str]; 4] = [
        &["run", spec],
        &["run", "--dry-run", spec],
        &["runs", "--backend", "kubernetes"],
        &["status", "--backend", "kubernetes"],
    ];
    for args in commands {
        let out = c.mflow(args).kubeconfig(kubeconfig).code(2).run().flat();
        out.contains(&format!("rejected the credentials of context \"mflow-e2e\" (user \"{user}\")"))
            .contains("HTTP 401")
            .contains("kubectl create token")
            .not_contains(token)
            .not_contains("forbidden")
            .not_contains("mflow kube rbac");
    }
    // Nor at the most verbose log level.
    c.mflow(["run", spec]).kubeconfig(kubeconfig).env("RUST_LOG", "trace").code(2).run().not_contains(token);
}

/// A garbage token and the token of a ServiceAccount deleted since (HTTP 401 from the API
/// server) are said to be rejected credentials of the context and user, never shown, and never
/// taken for missing rights; a server certificate signed by another CA is said to be untrusted.
pub fn rejected_credentials(c: &Case) {
    let spec = c.spec(CONNECT_STAGE).write();
    let state = &c.suite.state;

    let garbage = state.join("garbage.kubeconfig");
    let token = format!("e2egarbage{:032x}", random_u128());
    admin_kubeconfig_with(c, "token", &token, &garbage);
    rejected_everywhere(c, &garbage, &token, "admin", &spec);

    let sa = state.join("deleted-sa.kubeconfig");
    c.cluster().create_service_account("e2e-doomed");
    c.suite.script("cluster.sh", &["sa-kubeconfig", &c.suite.namespace, "e2e-doomed", &sa.display().to_string()]);
    let token = token_of(&sa);
    assert!(Cluster::answers_to(&sa), "the ServiceAccount's token is not accepted before its deletion");
    c.cluster().delete_service_account("e2e-doomed");
    wait_until(secs(30), "the deleted ServiceAccount's token to be refused", || !Cluster::answers_to(&sa));
    rejected_everywhere(c, &sa, &token, "system:serviceaccount:ml:e2e-doomed", &spec);
    assert_eq!(c.trainjobs().len(), 0, "TrainJobs");

    // The admin's own token with a CA that did not sign the server's certificate.
    let other = state.join("other-ca");
    std::fs::create_dir_all(&other).expect("a directory");
    let made = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=not-this-clusters-ca"])
        .arg("-keyout")
        .arg(other.join("ca.key"))
        .arg("-out")
        .arg(other.join("ca.crt"))
        .output()
        .expect("openssl");
    assert!(made.status.success(), "openssl: {}", String::from_utf8_lossy(&made.stderr));
    let wrong_ca = state.join("wrong-ca.kubeconfig");
    admin_kubeconfig_with(c, "certificate-authority", &other.join("ca.crt").display().to_string(), &wrong_ca);
    let token = token_of(&wrong_ca);
    for args in [vec!["run", spec.as_str()], vec!["runs", "--backend", "kubernetes"]] {
        c.mflow(args)
            .kubeconfig(&wrong_ca)
            .code(2)
            .run()
            .flat()
            .contains(
                "the certificate of the Kubernetes API server at https://127.0.0.1:6443/ is not trusted \
                 (context \"mflow-e2e\" (user \"admin\"))",
            )
            .contains("certificate-authority")
            .not_contains("check that the cluster is running")
            .not_contains(&token);
    }
}

/// 128 random bits, from the kernel.
fn random_u128() -> u128 {
    let bytes = std::fs::read("/proc/sys/kernel/random/uuid").expect("a random uuid");
    let hex: String = String::from_utf8_lossy(&bytes).chars().filter(char::is_ascii_hexdigit).collect();
    u128::from_str_radix(&hex, 16).expect("hex")
}

/// A namespace that does not exist is said to be missing (not a missing claim), with how to
/// create it, by `run`, `run --dry-run` and the commands that read runs; one whose name is over
/// Kubernetes' limit is refused before any request, naming the limit.
pub fn missing_namespace(c: &Case) {
    let spec = c.spec(CONNECT_STAGE).kube(r#"namespace = "e2e-nowhere""#).write();
    c.mflow(["run", &spec])
        .code(2)
        .run()
        .flat()
        .contains("namespace \"e2e-nowhere\" does not exist")
        .contains("kubectl create namespace e2e-nowhere")
        .not_contains("PersistentVolumeClaim");
    assert!(!c.workdir().join("runs").is_dir(), "a run started");
    c.mflow(["run", "--dry-run", &spec]).code(2).run().flat().contains("namespace \"e2e-nowhere\" does not exist");
    for cmd in ["runs", "status"] {
        c.mflow([cmd, "--backend", "kubernetes", "--namespace", "e2e-nowhere"])
            .code(2)
            .run()
            .flat()
            .contains("namespace \"e2e-nowhere\" does not exist")
            .not_contains("no runs started outside the cluster");
    }
    c.mflow(["cancel", "20260101-000000-000-aaaa", "--namespace", "e2e-nowhere"])
        .code(2)
        .run()
        .flat()
        .contains("namespace \"e2e-nowhere\" does not exist");

    let long = format!("team{}", "a".repeat(66));
    let spec = c.spec(CONNECT_STAGE).kube(&format!("namespace = \"{long}\"")).write();
    c.mflow(["run", &spec])
        .code(2)
        .run()
        .flat()
        .contains(&format!("namespace \"{long}\" is 70 characters long; Kubernetes allows at most 63"));
    c.mflow(["runs", "--backend", "kubernetes", "--namespace", &long])
        .code(2)
        .run()
        .flat()
        .contains("is 70 characters long; Kubernetes allows at most 63");
}
