//! What the server admits: the CRDs' schemas, `fieldValidation`, names and Trainer's webhooks.

use super::*;

/// A resource served from a CRD: its schema as JSON Schema and as a structural schema.
pub(super) struct Crd {
    pub(super) schema: jsonschema::Validator,
    pub(super) structural: Structural,
    pub(super) status_subresource: bool,
}

impl Crd {
    pub(super) fn load(file: &str) -> Crd {
        let crd = schema::crd(file);
        let structural = Structural::compile(&crd, "v1alpha1").unwrap_or_else(|e| panic!("{e}"));
        let version = crd["spec"]["versions"].as_array().and_then(|v| v.iter().find(|v| v["name"] == "v1alpha1"));
        let status_subresource = version.is_some_and(|v| v["subresources"].get("status").is_some());
        Crd { schema: schema::crd_validator(&crd), structural, status_subresource }
    }
}

/// A ValidatingAdmissionPolicy of the cluster, bound to TrainJobs: a rule of the cluster's
/// own (a quota of memory, trusted registries), which no client can check before it asks.
#[derive(Clone)]
pub struct Policy {
    pub name: String,
    /// What the policy says when `refuses` holds for an object.
    pub message: String,
    pub refuses: fn(&Value) -> bool,
}

/// The refusal of the first policy that refuses `obj`, as the API server words it: 422 with
/// reason Invalid, a policy's default.
pub(super) fn policy_denial(policies: &[Policy], resource: &str, obj: &Value) -> Result<(), Failure> {
    let Some(p) = policies.iter().find(|p| (p.refuses)(obj)) else { return Ok(()) };
    let name = json!(obj["metadata"]["name"].as_str().unwrap_or_default());
    let message = format!(
        "{resource}.{} {name} is forbidden: ValidatingAdmissionPolicy '{}' with binding '{}-binding' denied request: {}",
        group_of(resource),
        p.name,
        p.name,
        p.message
    );
    let code = StatusCode::UNPROCESSABLE_ENTITY;
    Err((code, status_body(code, "Invalid", &message)))
}

/// The `fieldValidation` query parameter of create and update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FieldValidation {
    Strict,
    Warn,
    Ignore,
}

impl FieldValidation {
    /// Without the parameter the real server warns and drops unknown fields; this one refuses
    /// them, so that a test sees what a real cluster would silently lose.
    pub(super) fn from_query(query: &HashMap<String, String>, options: &str) -> Result<FieldValidation, Failure> {
        match query.get("fieldValidation").map(String::as_str) {
            None | Some("") | Some("Strict") => Ok(FieldValidation::Strict),
            Some("Warn") => Ok(FieldValidation::Warn),
            Some("Ignore") => Ok(FieldValidation::Ignore),
            Some(other) => {
                let e = FieldError {
                    path: "fieldValidation".into(),
                    kind: ErrorKind::NotSupported(json!(other).to_string()),
                    detail: r#"supported values: "", "Ignore", "Strict", "Warn""#.into(),
                };
                let what = format!("{options}.meta.k8s.io");
                Err(invalid_failure(&what, "", "meta.k8s.io", options, std::slice::from_ref(&e), &[e.to_string()]))
            }
        }
    }
}

/// Go's JSON of a corev1.EnvVar: name, value (left out when empty), valueFrom.
pub(super) fn env_json(env: &Value) -> String {
    let mut out = format!("{{\"name\":{}", env["name"]);
    if let Some(v) = env["value"].as_str().filter(|v| !v.is_empty()) {
        out.push_str(&format!(",\"value\":{}", json!(v)));
    }
    if let Some(from) = env.get("valueFrom") {
        out.push_str(&format!(",\"valueFrom\":{from}"));
    }
    out.push('}');
    out
}

/// Trainer's defaulting webhook: every runtime patch carries the time it was last changed.
pub(super) fn stamp_patch_times(obj: &mut Value, old: Option<&Value>) {
    let old_patches = old.and_then(|o| o["spec"]["runtimePatches"].as_array()).cloned().unwrap_or_default();
    let Some(patches) = obj["spec"].get_mut("runtimePatches").and_then(Value::as_array_mut) else { return };
    for patch in patches {
        let before = old_patches.iter().find(|p| p["manager"] == patch["manager"]);
        let untimed = |p: &Value| {
            let mut p = p.clone();
            if let Some(m) = p.as_object_mut() {
                m.remove("time");
            }
            p
        };
        match before {
            Some(b) if untimed(b) == untimed(patch) && b.get("time").is_some() => patch["time"] = b["time"].clone(),
            _ if patch.get("time").is_none() => patch["time"] = json!(NOW),
            _ => {}
        }
    }
}

/// The fake cluster's clock.
pub(super) const NOW: &str = "2026-01-01T00:00:00Z";

/// The name rules of every custom resource (a DNS subdomain).
pub(super) fn name_errors(obj: &Value) -> Vec<FieldError> {
    let meta = &obj["metadata"];
    let name = meta["name"].as_str().unwrap_or_default();
    if name.is_empty() {
        return if meta["generateName"].as_str().is_some_and(|g| !g.is_empty()) {
            Vec::new()
        } else {
            vec![FieldError {
                path: "metadata.name".into(),
                kind: ErrorKind::Required,
                detail: "name or generateName is required".into(),
            }]
        };
    }
    let shown = Some(json!(name).to_string());
    let mut errors = Vec::new();
    if name.len() > 253 {
        errors.push(FieldError::invalid("metadata.name", shown.clone(), "must be no more than 253 characters"));
    }
    let label = |l: &str| {
        !l.is_empty()
            && l.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if !name.split('.').all(label) {
        errors.push(FieldError::invalid(
            "metadata.name",
            shown,
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')",
        ));
    }
    errors
}

/// `utilerrors.Aggregate`: one message alone, several in brackets, duplicates once.
pub(super) fn aggregate(messages: &[String]) -> String {
    let mut seen: Vec<&String> = Vec::new();
    for m in messages {
        if !seen.contains(&m) {
            seen.push(m);
        }
    }
    let joined = seen.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ");
    if seen.len() == 1 {
        joined
    } else {
        format!("[{joined}]")
    }
}

/// A 422 Invalid Status: `Kind.group "name" is invalid: ...`, with a cause per field error.
pub(super) fn invalid_failure(
    what: &str,
    name: &str,
    group: &str,
    kind: &str,
    errors: &[FieldError],
    messages: &[String],
) -> Failure {
    let code = StatusCode::UNPROCESSABLE_ENTITY;
    let mut body = status_body(code, "Invalid", &format!("{what} {} is invalid: {}", json!(name), aggregate(messages)));
    let causes: Vec<Value> =
        errors.iter().map(|e| json!({"reason": e.cause_reason(), "message": e.body(), "field": e.path})).collect();
    body["details"] = json!({"name": name, "group": group, "kind": kind, "causes": causes});
    (code, body)
}
