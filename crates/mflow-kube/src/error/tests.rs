use super::*;

#[test]
fn errors_are_described_in_words_not_debug_dumps() {
    let status = kube::core::Status::failure(
        "pods \"p\" is forbidden: User \"nobody\" cannot get resource \"pods/log\"",
        "Forbidden",
    )
    .with_code(403);
    let text = describe(&kube::Error::Api(Box::new(status.clone())));
    assert_eq!(text, "pods \"p\" is forbidden: User \"nobody\" cannot get resource \"pods/log\" (Forbidden, HTTP 403)");
    assert!(!text.contains("Status {") && !text.contains("Some("), "{text}");
    // A webhook's refusal is about the object, not about the caller's rights.
    let denial = kube::core::Status::failure("admission webhook \"validator.trainjob.trainer.kubeflow.org\" denied the request: spec.trainer.env: Invalid value", "Forbidden").with_code(403);
    assert!(is_admission_denial(&denial));
    assert!(!is_admission_denial(&status));
    let e = KubeError::from_call(
        kube::Error::Api(Box::new(denial)),
        "create",
        "trainjobs",
        "x",
        Some("ml"),
        "ml",
        &target(),
    );
    assert!(matches!(e, KubeError::Api { .. }), "{e:?}");
    // Cluster-scoped resources are not said to be in a namespace.
    let e = KubeError::from_call(
        kube::Error::Api(Box::new(status)),
        "get",
        "clustertrainingruntimes",
        "x",
        None,
        "ml",
        &target(),
    );
    assert!(e.to_string().starts_with("forbidden:"), "{e}");
    assert!(e.to_string().contains("clustertrainingruntimes (cluster-scoped)"), "{e}");
}

fn target() -> Target {
    Target {
        url: "https://10.0.0.1:6443/".into(),
        context: Some("dev".into()),
        user: Some("alice".into()),
        ..Target::default()
    }
}

fn api(code: u16, reason: &str, message: &str) -> kube::Error {
    kube::Error::Api(Box::new(kube::core::Status::failure(message, reason).with_code(code)))
}

#[test]
fn a_rejected_credential_names_the_context_and_user_not_rights() {
    for (verb, resource, ns) in
        [("get", "version", None), ("list", "jobs", Some("ml")), ("create", "selfsubjectaccessreviews", None)]
    {
        let e = KubeError::from_call(api(401, "Unauthorized", "Unauthorized"), verb, resource, "", ns, "ml", &target());
        assert!(matches!(e, KubeError::Unauthorized { .. }), "{e:?}");
        assert_eq!(e.to_string(), "the Kubernetes API server at https://10.0.0.1:6443/ rejected the credentials of context \"dev\" (user \"alice\") (HTTP 401: Unauthorized)");
        let help = e.help().unwrap().to_string();
        assert!(
            help.contains("kubectl create token") && help.contains("--context dev") && !help.contains("rbac"),
            "{help}"
        );
        assert!(e.is_users_to_fix());
    }
    // In a pod, the identity is its service account.
    let pod = Target { url: "https://10.96.0.1:443/".into(), in_cluster: true, ..Target::default() };
    let e = KubeError::of_connection(&api(401, "Unauthorized", ""), &pod).unwrap();
    assert!(
        e.to_string().contains("rejected the credentials of the pod's service account (HTTP 401: Unauthorized)"),
        "{e}"
    );
    // A refusal of rights stays one.
    let e = KubeError::from_call(
        api(403, "Forbidden", "jobs is forbidden"),
        "list",
        "jobs",
        "",
        Some("ml"),
        "ml",
        &target(),
    );
    assert!(matches!(e, KubeError::Forbidden { .. }) && !e.is_users_to_fix(), "{e:?}");
}

#[test]
fn an_untrusted_certificate_is_not_an_unreachable_server() {
    // How the TLS connector hands the verifier's refusal to the client: inside an I/O error.
    let tls = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
    let io = std::io::Error::new(std::io::ErrorKind::InvalidData, tls);
    let e = KubeError::of_connection(&kube::Error::Service(Box::new(io)), &target()).unwrap();
    assert!(matches!(e, KubeError::UntrustedCertificate { .. }), "{e:?}");
    assert_eq!(e.to_string(), "the certificate of the Kubernetes API server at https://10.0.0.1:6443/ is not trusted (context \"dev\" (user \"alice\")): invalid peer certificate: UnknownIssuer");
    assert!(e.help().unwrap().to_string().contains("certificate-authority"));
    assert!(e.is_users_to_fix());
    // A refused connection is still unreachable, and not the user's to fix.
    let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
    let e = KubeError::of_connection(&kube::Error::Service(Box::new(refused)), &target()).unwrap();
    assert!(matches!(e, KubeError::Unreachable { .. }) && !e.is_users_to_fix(), "{e:?}");
    assert!(e.help().unwrap().to_string().contains("kubectl --context dev get ns"));
}

#[test]
fn a_missing_namespace_is_not_a_missing_object() {
    // What the API server answers to a create in a namespace that does not exist.
    let status: kube::core::Status =
        serde_json::from_value(serde_json::json!({"status": "Failure", "code": 404, "reason": "NotFound",
        "message": "namespaces \"nowhere\" not found", "details": {"name": "nowhere", "kind": "namespaces"}}))
        .unwrap();
    let e = KubeError::from_call(
        kube::Error::Api(Box::new(status)),
        "create",
        "trainjobs",
        "p-s-1234",
        Some("nowhere"),
        "nowhere",
        &target(),
    );
    assert_eq!(e.to_string(), "namespace \"nowhere\" does not exist on the cluster at https://10.0.0.1:6443/");
    assert!(e.help().unwrap().to_string().contains("kubectl create namespace nowhere"));
    assert!(e.is_users_to_fix());
    // A 404 about the object itself is not about the namespace.
    let e = KubeError::from_call(
        api(404, "NotFound", "trainjobs \"x\" not found"),
        "get",
        "trainjobs",
        "x",
        Some("ml"),
        "ml",
        &target(),
    );
    assert!(matches!(e, KubeError::Api { .. }), "{e:?}");
}
