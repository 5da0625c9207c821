//! What the API server does with a custom resource beyond its OpenAPI schema: it drops (or, under
//! `fieldValidation=Strict`, refuses) unknown fields, applies the schema's defaults, and
//! evaluates the CRD's `x-kubernetes-validations` CEL rules, transition rules (`oldSelf`) on
//! updates only. Field errors read like the API server's (Kubernetes v1.35).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;

use cel::objects::Key;
use cel::{Context, Env, ExecutionError, Program, Value as Cel};
use miette::Diagnostic;
use serde_json::Value;
use thiserror::Error;

mod rules;
use rules::*;

#[derive(Debug, Error, Diagnostic)]
pub enum StructuralError {
    #[error("{crd}: {} x-kubernetes-validations rule(s) cannot be evaluated by the cel crate:\n{}", rules.len(), rules.join("\n"))]
    #[diagnostic(
        code(mflow::kube::testing::uncompilable_rules),
        help("the fake API server would let these rules pass unchecked: support the construct (or the function) in testing/structural.rs")
    )]
    Uncompilable { crd: String, rules: Vec<String> },

    #[error("{crd}: no served version {version} with an openAPIV3Schema")]
    #[diagnostic(code(mflow::kube::testing::no_schema))]
    NoSchema { crd: String, version: String },
}

/// Functions and operators of the CEL standard definitions that the `cel` crate implements;
/// a rule calling anything else (Kubernetes' CEL libraries: `isSorted`, `url`, `quantity`, ...)
/// counts as not compiled rather than failing at run time.
const SUPPORTED_FUNCTIONS: &[&str] = &[
    "!_",
    "-_",
    "_!=_",
    "_%_",
    "_&&_",
    "_*_",
    "_+_",
    "_-_",
    "_/_",
    "_<=_",
    "_<_",
    "_==_",
    "_>=_",
    "_>_",
    "_?_:_",
    "_[_]",
    "_||_",
    "@in",
    "@not_strictly_false",
    "size",
    "matches",
    "contains",
    "startsWith",
    "endsWith",
    "string",
    "int",
    "uint",
    "double",
    "bytes",
    "bool",
    "type",
    "dyn",
];

/// The fields of ObjectMeta a client may send; the CRD schema leaves `metadata` open.
const OBJECT_META: &[&str] = &[
    "name",
    "generateName",
    "namespace",
    "selfLink",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "labels",
    "annotations",
    "ownerReferences",
    "finalizers",
    "managedFields",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reason {
    Invalid,
    Forbidden,
    Required,
    Duplicate,
}

struct Rule {
    source: String,
    program: Program,
    message: Option<String>,
    message_expression: Option<Program>,
    field_path: Option<String>,
    reason: Reason,
    uses_old_self: bool,
}

#[derive(Default)]
enum ListType {
    #[default]
    Atomic,
    Set,
    Map(Vec<String>),
}

/// One node of a structural schema.
#[derive(Default)]
struct Node {
    ty: String,
    properties: BTreeMap<String, Node>,
    items: Option<Box<Node>>,
    values: Option<Box<Node>>,
    preserve_unknown: bool,
    nullable: bool,
    default: Option<Value>,
    list: ListType,
    rules: Vec<Rule>,
}

/// The bad value of a field error: Kubernetes v1.35 shows scalars and leaves out objects and
/// lists.
#[derive(Clone, Debug, PartialEq)]
pub enum ErrorKind {
    Invalid(Option<String>),
    Forbidden,
    Required,
    Duplicate(String),
    NotSupported(String),
}

/// A `field.Error` of the API server.
#[derive(Clone, Debug, PartialEq)]
pub struct FieldError {
    /// Empty for the object itself (the server prints `<nil>`).
    pub path: String,
    pub kind: ErrorKind,
    pub detail: String,
}

impl FieldError {
    pub fn invalid(path: &str, value: Option<String>, detail: &str) -> FieldError {
        FieldError { path: path.into(), kind: ErrorKind::Invalid(value), detail: detail.into() }
    }

    /// The error without its field, as in a Status cause.
    pub fn body(&self) -> String {
        let head = match &self.kind {
            ErrorKind::Invalid(Some(v)) => format!("Invalid value: {v}"),
            ErrorKind::Invalid(None) => "Invalid value".into(),
            ErrorKind::Forbidden => "Forbidden".into(),
            ErrorKind::Required => "Required value".into(),
            ErrorKind::Duplicate(v) => return format!("Duplicate value: {v}"),
            ErrorKind::NotSupported(v) => format!("Unsupported value: {v}"),
        };
        if self.detail.is_empty() {
            head
        } else {
            format!("{head}: {}", self.detail)
        }
    }

    /// The `reason` of a Status cause.
    pub fn cause_reason(&self) -> &'static str {
        match self.kind {
            ErrorKind::Invalid(_) => "FieldValueInvalid",
            ErrorKind::Forbidden => "FieldValueForbidden",
            ErrorKind::Required => "FieldValueRequired",
            ErrorKind::Duplicate(_) => "FieldValueDuplicate",
            ErrorKind::NotSupported(_) => "FieldValueNotSupported",
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = if self.path.is_empty() { "<nil>" } else { &self.path };
        write!(f, "{path}: {}", self.body())
    }
}

/// How Go's `%v`/`%q` print a scalar in a field error; None for objects and lists.
pub fn scalar(value: &Value) -> Option<String> {
    match value {
        Value::Object(_) | Value::Array(_) => None,
        Value::Null => Some("null".into()),
        other => Some(other.to_string()),
    }
}

fn child(path: &str, name: &str) -> String {
    if path.is_empty() {
        name.to_string()
    } else {
        format!("{path}.{name}")
    }
}

/// The evaluated rules of one CRD version, with the schema that places them.
pub struct Structural {
    root: Node,
    env: Arc<Env>,
    rules: usize,
}

impl Structural {
    /// Reads the schema of `version` and compiles every rule; fails listing each rule that the
    /// `cel` crate cannot parse or whose functions it lacks.
    pub fn compile(crd: &Value, version: &str) -> Result<Structural, StructuralError> {
        let name = crd["metadata"]["name"].as_str().unwrap_or("CRD").to_string();
        let schema = crd["spec"]["versions"]
            .as_array()
            .and_then(|vs| vs.iter().find(|v| v["name"] == version))
            .map(|v| &v["schema"]["openAPIV3Schema"])
            .filter(|s| s.is_object())
            .ok_or_else(|| StructuralError::NoSchema { crd: name.clone(), version: version.into() })?;
        let mut failed = Vec::new();
        let mut rules = 0;
        let root = Node::parse(schema, "", &mut failed, &mut rules);
        if !failed.is_empty() {
            return Err(StructuralError::Uncompilable { crd: name, rules: failed });
        }
        Ok(Structural { root, env: Arc::new(Env::stdlib()), rules })
    }

    /// How many rules the CRD version has (all of them compiled).
    pub fn rule_count(&self) -> usize {
        self.rules
    }

    /// Removes the fields the schema does not know, returning their paths (`spec.foo`,
    /// `spec.trainer.env[0].bar`) in the order of the API server's strict decoding error.
    pub fn prune(&self, obj: &mut Value) -> Vec<String> {
        let mut unknown = Vec::new();
        if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
            let extra: Vec<String> = meta.keys().filter(|k| !OBJECT_META.contains(&k.as_str())).cloned().collect();
            for k in extra {
                meta.remove(&k);
                unknown.push(format!("metadata.{k}"));
            }
        }
        let mut pruned = Vec::new();
        prune(&self.root, "", obj, &mut pruned, true);
        pruned.sort();
        pruned.extend(unknown);
        pruned
    }

    /// Applies the schema's defaults and drops nulls of fields that are not nullable, as the
    /// API server does before validation.
    pub fn default(&self, obj: &mut Value) {
        default(&self.root, obj);
    }

    /// Evaluates every rule where its field is present; with `old` (an update), transition
    /// rules too, against the old value at the same place. Returns the errors, and the failures
    /// of rules on unchanged values, which the server only warns about (validation ratcheting).
    pub fn validate(&self, new: &Value, old: Option<&Value>) -> (Vec<FieldError>, Vec<FieldError>) {
        let mut out = Outcome::default();
        self.walk(&self.root, "", new, old, true, &mut out);
        (out.errors, out.ratcheted)
    }

    fn walk(&self, node: &Node, path: &str, new: &Value, old: Option<&Value>, root: bool, out: &mut Outcome) {
        // Only present, non-null values are validated.
        if new.is_null() {
            return;
        }
        if !node.rules.is_empty() {
            self.check(node, path, new, old, root, out);
        }
        match new {
            Value::Object(map) => {
                for (k, v) in map {
                    let old_v = old.and_then(|o| o.get(k));
                    if let Some(prop) = node.properties.get(k) {
                        if !(root && k == "metadata") {
                            self.walk(prop, &child(path, k), v, old_v, false, out);
                        }
                    } else if let Some(values) = &node.values {
                        self.walk(values, &format!("{path}[{k}]"), v, old_v, false, out);
                    }
                }
            }
            Value::Array(list) => {
                let Some(item) = &node.items else { return };
                for (i, v) in list.iter().enumerate() {
                    // Only items of map lists correlate with an old item (by their keys).
                    let old_v = match (&node.list, old.and_then(Value::as_array)) {
                        (ListType::Map(keys), Some(old_list)) => {
                            old_list.iter().find(|o| keys.iter().all(|k| o.get(k) == v.get(k)))
                        }
                        _ => None,
                    };
                    self.walk(item, &format!("{path}[{i}]"), v, old_v, false, out);
                }
            }
            _ => {}
        }
    }

    fn check(&self, node: &Node, path: &str, new: &Value, old: Option<&Value>, root: bool, out: &mut Outcome) {
        let this = if root { root_view(node, new) } else { to_cel(node, new) };
        let before = old.map(|o| if root { root_view(node, o) } else { to_cel(node, o) });
        let unchanged = old == Some(new);
        for rule in &node.rules {
            if rule.uses_old_self && before.is_none() {
                continue;
            }
            let mut ctx = Context::with_env(self.env.clone());
            ctx.add_variable_from_value("self", this.clone());
            if let Some(before) = &before {
                ctx.add_variable_from_value("oldSelf", before.clone());
            }
            // The schema type the server names in runtime errors (none for int-or-string).
            let ty = match node.ty.as_str() {
                "int-or-string" => "",
                t => t,
            };
            match rule.program.execute(&ctx) {
                Ok(Cel::Bool(true)) => continue,
                Ok(Cel::Bool(false)) => {}
                Ok(other) => {
                    let detail = format!("rule evaluated to {other:?}, not a bool: {}", rule.error_string());
                    out.errors.push(FieldError::invalid(path, Some(format!("{ty:?}")), &detail));
                    continue;
                }
                Err(e) => {
                    // Runtime errors are never ratcheted, and name the schema type.
                    let detail = match &e {
                        ExecutionError::NoSuchOverload(_) => format!(
                            "'no such overload': call arguments did not match a supported operator, function or macro signature for rule: {}",
                            rule.error_string()
                        ),
                        other => format!("{} evaluating rule: {}", runtime_error(other), rule.error_string()),
                    };
                    out.errors.push(FieldError::invalid(path, Some(format!("{ty:?}")), &detail));
                    continue;
                }
            }
            let detail = rule
                .message_expression
                .as_ref()
                .and_then(|p| match p.execute(&ctx) {
                    Ok(Cel::String(s)) if !s.trim().is_empty() && !s.contains(['\n', '\r']) => {
                        Some(s.trim().to_string())
                    }
                    _ => None,
                })
                .unwrap_or_else(|| rule.message_or_default());
            let at = match &rule.field_path {
                Some(p) => child(path, p),
                None => path.to_string(),
            };
            let kind = match rule.reason {
                Reason::Invalid => ErrorKind::Invalid(scalar(new)),
                Reason::Forbidden => ErrorKind::Forbidden,
                Reason::Required => ErrorKind::Required,
                Reason::Duplicate => ErrorKind::Duplicate(scalar(new).unwrap_or_default()),
            };
            let err = FieldError { path: at, kind, detail };
            if !rule.uses_old_self && unchanged {
                out.ratcheted.push(err);
            } else {
                out.errors.push(err);
            }
        }
    }
}

impl Node {
    fn parse(schema: &Value, at: &str, failed: &mut Vec<String>, count: &mut usize) -> Node {
        let flag = |k: &str| schema.get(k) == Some(&Value::Bool(true));
        let mut node = Node {
            ty: schema["type"].as_str().unwrap_or_default().to_string(),
            preserve_unknown: flag("x-kubernetes-preserve-unknown-fields"),
            nullable: flag("nullable"),
            default: schema.get("default").cloned(),
            ..Node::default()
        };
        if flag("x-kubernetes-int-or-string") {
            node.ty = "int-or-string".into();
        }
        node.list = match schema["x-kubernetes-list-type"].as_str() {
            Some("set") => ListType::Set,
            Some("map") => ListType::Map(
                schema["x-kubernetes-list-map-keys"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|k| k.as_str().map(String::from))
                    .collect(),
            ),
            _ => ListType::Atomic,
        };
        for rule in schema["x-kubernetes-validations"].as_array().into_iter().flatten() {
            *count += 1;
            if let Some(rule) = Rule::parse(rule, at, failed) {
                node.rules.push(rule);
            }
        }
        if let Some(props) = schema["properties"].as_object() {
            for (k, v) in props {
                node.properties.insert(k.clone(), Node::parse(v, &child(at, k), failed, count));
            }
        }
        if schema.get("items").is_some_and(Value::is_object) {
            node.items = Some(Box::new(Node::parse(&schema["items"], &format!("{at}[*]"), failed, count)));
        }
        if schema.get("additionalProperties").is_some_and(Value::is_object) {
            node.values =
                Some(Box::new(Node::parse(&schema["additionalProperties"], &format!("{at}[*]"), failed, count)));
        }
        node
    }

    /// Fields of an object are pruned unless the schema keeps unknown fields or maps them.
    fn keeps_unknown(&self) -> bool {
        self.preserve_unknown || self.values.is_some()
    }
}

fn prune(node: &Node, path: &str, value: &mut Value, out: &mut Vec<String>, root: bool) {
    match value {
        Value::Object(map) => {
            if !node.keeps_unknown() {
                let extra: Vec<String> = map.keys().filter(|k| !node.properties.contains_key(*k)).cloned().collect();
                for k in extra {
                    map.remove(&k);
                    out.push(child(path, &k));
                }
            }
            for (k, v) in map.iter_mut() {
                // The root's metadata is ObjectMeta, checked on its own.
                if root && k == "metadata" {
                    continue;
                }
                if let Some(prop) = node.properties.get(k) {
                    prune(prop, &child(path, k), v, out, false);
                } else if let Some(values) = &node.values {
                    prune(values, &format!("{path}[{k}]"), v, out, false);
                }
            }
        }
        Value::Array(list) => {
            if let Some(item) = &node.items {
                for (i, v) in list.iter_mut().enumerate() {
                    prune(item, &format!("{path}[{i}]"), v, out, false);
                }
            }
        }
        _ => {}
    }
}

fn default(node: &Node, value: &mut Value) {
    match value {
        Value::Object(map) => {
            for (k, prop) in &node.properties {
                match (map.get(k), &prop.default) {
                    (None, Some(d)) => {
                        map.insert(k.clone(), d.clone());
                    }
                    (Some(Value::Null), Some(d)) if !prop.nullable => {
                        map.insert(k.clone(), d.clone());
                    }
                    (Some(Value::Null), None) if !prop.nullable => {
                        map.remove(k);
                    }
                    _ => {}
                }
            }
            for (k, v) in map.iter_mut() {
                if let Some(prop) = node.properties.get(k) {
                    default(prop, v);
                } else if let Some(values) = &node.values {
                    default(values, v);
                }
            }
        }
        Value::Array(list) => {
            if let Some(item) = &node.items {
                list.iter_mut().for_each(|v| default(item, v));
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests;
