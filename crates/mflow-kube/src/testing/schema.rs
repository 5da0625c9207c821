//! The real Kubeflow CRDs (from the shared Kubeflow data next to the repository) as JSON Schema.

use std::path::PathBuf;

use serde_json::Value;

/// `MFLOW_KUBEFLOW_DIR`, or `../shared/kubeflow` next to the repository root.
pub fn kubeflow_dir() -> PathBuf {
    match std::env::var_os("MFLOW_KUBEFLOW_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/kubeflow"),
    }
}

pub fn load_yaml(rel: &str) -> Value {
    let path = kubeflow_dir().join(rel);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (set MFLOW_KUBEFLOW_DIR to the Kubeflow CRD data)", path.display()));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The CRD object of a file under crds/.
pub fn crd(file: &str) -> Value {
    load_yaml(&format!("crds/{file}"))
}

/// The openAPIV3Schema of the CRD's v1alpha1 version, made strict JSON Schema.
pub fn crd_validator(crd: &Value) -> jsonschema::Validator {
    let versions = crd["spec"]["versions"].as_array().expect("CRD versions");
    let version = versions.iter().find(|v| v["name"] == "v1alpha1").expect("v1alpha1");
    let mut schema = version["schema"]["openAPIV3Schema"].clone();
    to_json_schema(&mut schema);
    jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .should_validate_formats(false)
        .build(&schema)
        .expect("CRD schema compiles")
}

/// Rewrites OpenAPI v3 structural-schema extensions into JSON Schema:
/// `nullable` widens the type, `x-kubernetes-int-or-string` accepts both, and objects with
/// declared properties reject unknown fields (as `fieldValidation=Strict` does), unless they
/// preserve unknown fields.
pub fn to_json_schema(node: &mut Value) {
    let Some(obj) = node.as_object_mut() else { return };
    if obj.get("nullable") == Some(&Value::Bool(true)) {
        if let Some(Value::String(t)) = obj.get("type").cloned() {
            obj.insert("type".into(), serde_json::json!([t, "null"]));
        }
    }
    if obj.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true)) {
        obj.remove("type");
        obj.entry("anyOf").or_insert(serde_json::json!([{"type": "integer"}, {"type": "string"}]));
    }
    let preserve = obj.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
    if obj.contains_key("properties") && !preserve && !obj.contains_key("additionalProperties") {
        obj.insert("additionalProperties".into(), Value::Bool(false));
    }
    if let Some(Value::Object(props)) = obj.get_mut("properties") {
        props.values_mut().for_each(to_json_schema);
    }
    for key in ["items", "additionalProperties", "not"] {
        if let Some(child) = obj.get_mut(key) {
            to_json_schema(child);
        }
    }
    for key in ["anyOf", "allOf", "oneOf"] {
        if let Some(Value::Array(list)) = obj.get_mut(key) {
            list.iter_mut().for_each(to_json_schema);
        }
    }
}

/// Every schema violation, one per line with its JSON pointer.
pub fn violations(validator: &jsonschema::Validator, instance: &Value) -> Vec<String> {
    validator.iter_errors(instance).map(|e| format!("{}: {}", e.instance_path(), e)).collect()
}

/// The violations, and whether one of them keeps the API server from evaluating the CEL rules
/// (a wrong type, a missing required field, a value over its limit, or not in its enum).
pub fn check(validator: &jsonschema::Validator, instance: &Value) -> (Vec<String>, bool) {
    use jsonschema::error::ValidationErrorKind as K;
    let mut blocking = false;
    let found = validator
        .iter_errors(instance)
        .map(|e| {
            blocking |= matches!(
                e.kind(),
                K::Type { .. }
                    | K::Required { .. }
                    | K::MaxLength { .. }
                    | K::MaxItems { .. }
                    | K::MaxProperties { .. }
                    | K::Enum { .. }
                    | K::AnyOf { .. }
            );
            format!("{}: {}", e.instance_path(), e)
        })
        .collect();
    (found, blocking)
}
