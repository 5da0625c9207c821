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
    "!_", "-_", "_!=_", "_%_", "_&&_", "_*_", "_+_", "_-_", "_/_", "_<=_", "_<_", "_==_", "_>=_", "_>_",
    "_?_:_", "_[_]", "_||_", "@in", "@not_strictly_false", "size", "matches", "contains", "startsWith",
    "endsWith", "string", "int", "uint", "double", "bytes", "bool", "type", "dyn",
];

/// The fields of ObjectMeta a client may send; the CRD schema leaves `metadata` open.
const OBJECT_META: &[&str] = &[
    "name", "generateName", "namespace", "selfLink", "uid", "resourceVersion", "generation",
    "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "labels", "annotations",
    "ownerReferences", "finalizers", "managedFields",
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
                    Ok(Cel::String(s)) if !s.trim().is_empty() && !s.contains(['\n', '\r']) => Some(s.trim().to_string()),
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

#[derive(Default)]
struct Outcome {
    errors: Vec<FieldError>,
    ratcheted: Vec<FieldError>,
}

/// cel-go's wording of the runtime errors the server quotes.
fn runtime_error(e: &ExecutionError) -> String {
    match e {
        ExecutionError::NoSuchKey(k) => format!("no such key: {k}"),
        ExecutionError::IndexOutOfBounds(i) => format!("index out of bounds: {i:?}"),
        ExecutionError::DivisionByZero(_) => "division by zero".into(),
        ExecutionError::RemainderByZero(_) => "modulus by zero".into(),
        ExecutionError::Overflow(..) => "integer overflow".into(),
        other => other.to_string(),
    }
}

impl Rule {
    fn parse(spec: &Value, at: &str, failed: &mut Vec<String>) -> Option<Rule> {
        let source = spec["rule"].as_str().unwrap_or_default().to_string();
        let compiled = compile(&source);
        let message_expression = spec["messageExpression"].as_str().map(|m| (m, compile(m)));
        let shown = if at.is_empty() { "<root>" } else { at };
        if let Err(why) = &compiled {
            failed.push(format!("{shown}: {source}: {why}"));
        }
        if let Some((m, Err(why))) = &message_expression {
            failed.push(format!("{shown}: messageExpression {m}: {why}"));
        }
        let reason = match spec["reason"].as_str() {
            Some("FieldValueForbidden") => Reason::Forbidden,
            Some("FieldValueRequired") => Reason::Required,
            Some("FieldValueDuplicate") => Reason::Duplicate,
            _ => Reason::Invalid,
        };
        let program = compiled.ok()?;
        let uses_old_self = program.references().has_variable("oldSelf");
        Some(Rule {
            source,
            program,
            message: spec["message"].as_str().map(|m| m.trim().to_string()).filter(|m| !m.is_empty()),
            message_expression: message_expression.and_then(|(_, p)| p.ok()),
            field_path: spec["fieldPath"].as_str().map(normalize_field_path),
            reason,
            uses_old_self,
        })
    }

    /// `ruleErrorString`: the message, else the rule.
    fn error_string(&self) -> String {
        self.message.clone().unwrap_or_else(|| self.source.trim().to_string())
    }

    /// `ruleMessageOrDefault`.
    fn message_or_default(&self) -> String {
        self.message.clone().unwrap_or_else(|| format!("failed rule: {}", self.source.trim()))
    }
}

fn compile(source: &str) -> Result<Program, String> {
    let program = Program::compile(source).map_err(|e| e.to_string().replace('\n', " "))?;
    let refs = program.references();
    let mut missing: Vec<&str> = refs.functions().into_iter().filter(|f| !SUPPORTED_FUNCTIONS.contains(f)).collect();
    if !missing.is_empty() {
        missing.sort();
        return Err(format!("unsupported function(s) {}", missing.join(", ")));
    }
    Ok(program)
}

/// `.a.b` or `.a['b.c']` as the server prints it after the rule's field: `a.b`, `a.b.c`.
fn normalize_field_path(path: &str) -> String {
    let mut parts = Vec::new();
    let mut rest = path.trim();
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix('[') {
            let end = r.find(']').unwrap_or(r.len());
            parts.push(r[..end].trim_matches('\'').to_string());
            rest = r.get(end + 1..).unwrap_or("");
        } else {
            let r = rest.strip_prefix('.').unwrap_or(rest);
            let end = r.find(['.', '[']).unwrap_or(r.len());
            if end == 0 && r.len() == rest.len() {
                break;
            }
            parts.push(r[..end].to_string());
            rest = &r[end..];
        }
    }
    parts.retain(|p| !p.is_empty());
    parts.join(".")
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
            node.values = Some(Box::new(Node::parse(&schema["additionalProperties"], &format!("{at}[*]"), failed, count)));
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

/// The object as rules on the root see it: of its metadata, only name and generateName.
fn root_view(node: &Node, obj: &Value) -> Cel {
    let mut obj = obj.clone();
    if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.retain(|k, _| k == "name" || k == "generateName");
    }
    to_cel(node, &obj)
}

/// Kubernetes' escaping of property names that are not CEL identifiers. Keywords stay as they
/// are: the runtime CRDs' own rules select `metadata.namespace` as written.
fn escape(name: &str) -> String {
    if !name.contains(['.', '-', '/']) && !name.contains("__") {
        return name.to_string();
    }
    name.replace("__", "__underscores__").replace('.', "__dot__").replace('-', "__dash__").replace('/', "__slash__")
}

fn to_cel(node: &Node, value: &Value) -> Cel {
    match value {
        Value::Null => Cel::Null,
        Value::Bool(b) => Cel::Bool(*b),
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) if node.ty != "number" => Cel::Int(i),
            (None, Some(u)) if node.ty != "number" => Cel::UInt(u),
            _ => Cel::Float(n.as_f64().unwrap_or_default()),
        },
        Value::String(s) => Cel::String(Arc::new(s.clone())),
        Value::Array(list) => {
            let blank = Node::default();
            let item = node.items.as_deref().unwrap_or(&blank);
            let mut items: Vec<(String, Cel)> = list.iter().map(|v| (v.to_string(), to_cel(item, v))).collect();
            // Sets and map lists compare equal whatever their order: a canonical order does it.
            if !matches!(node.list, ListType::Atomic) {
                items.sort_by(|a, b| a.0.cmp(&b.0));
            }
            Cel::List(Arc::new(items.into_iter().map(|(_, v)| v).collect()))
        }
        Value::Object(map) => {
            let blank = Node::default();
            let mut out: HashMap<Key, Cel> = HashMap::with_capacity(map.len());
            for (k, v) in map {
                let (key, sub) = match (node.properties.get(k), &node.values) {
                    (Some(prop), _) => (escape(k), prop),
                    (None, Some(values)) => (k.clone(), values.as_ref()),
                    (None, None) => (k.clone(), &blank),
                };
                out.insert(Key::String(Arc::new(key)), to_cel(sub, v));
            }
            Cel::from(out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn crd(schema: Value) -> Structural {
        let crd = json!({"metadata": {"name": "things.example.com"},
            "spec": {"versions": [{"name": "v1", "schema": {"openAPIV3Schema": schema}}]}});
        Structural::compile(&crd, "v1").unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn every_supported_function_is_there() {
        let env = Arc::new(Env::stdlib());
        for source in [
            "!false", "-(1) == -1", "1 != 2", "5 % 2 == 1", "true && true", "2 * 3 == 6", "1 + 1 == 2",
            "3 - 1 == 2", "4 / 2 == 2", "1 <= 1", "1 < 2", "2 >= 1", "2 > 1", "(true ? 1 : 2) == 1",
            "[1][0] == 1", "false || true", "1 in [1]", "[1].all(x, x > 0)", "size('ab') == 2",
            "'ab'.matches('^a')", "'ab'.contains('b')", "'ab'.startsWith('a')", "'ab'.endsWith('b')",
            "string(1) == '1'", "int('2') == 2", "uint(2) == uint(2)", "double(1) == 1.0",
            "bytes('a') == b'a'", "bool('true')", "type(1) == int", "dyn(1) == 1",
        ] {
            let program = compile(source).unwrap_or_else(|e| panic!("{source}: {e}"));
            let got = program.execute(&Context::with_env(env.clone()));
            assert_eq!(got, Ok(Cel::Bool(true)), "{source}");
        }
        assert!(compile("self.isSorted()").unwrap_err().contains("isSorted"));
        assert!(compile("self.matches(").is_err());
    }

    #[test]
    fn unsupported_rules_are_listed() {
        let crd = json!({"metadata": {"name": "things.example.com"}, "spec": {"versions": [{"name": "v1",
            "schema": {"openAPIV3Schema": {"type": "object", "properties": {"spec": {"type": "object",
                "x-kubernetes-validations": [{"rule": "self.x.isSorted()"}, {"rule": "has(self.x)"},
                    {"rule": "true", "messageExpression": "self.y.lowerAscii()"}]}}}}}]}});
        let err = Structural::compile(&crd, "v1").err().expect("must fail");
        let text = err.to_string();
        assert!(text.contains("spec: self.x.isSorted(): unsupported function(s) isSorted"), "{text}");
        assert!(text.contains("spec: messageExpression self.y.lowerAscii()"), "{text}");
        assert!(!text.contains("has(self.x)"), "{text}");
    }

    #[test]
    fn messages_reasons_and_field_paths_are_the_servers() {
        let s = crd(json!({"type": "object", "properties": {"spec": {"type": "object",
            "properties": {"n": {"type": "integer"}, "s": {"type": "string"}, "o": {"type": "object", "properties": {"a": {"type": "string"}}}},
            "x-kubernetes-validations": [
                {"rule": "!has(self.n) || self.n > 0"},
                {"rule": "!has(self.s) || self.s != 'x'", "message": "s must not be x", "reason": "FieldValueForbidden", "fieldPath": ".s"},
                {"rule": "!has(self.o) || has(self.o.a)", "messageExpression": "'o needs a, has ' + string(size(self.o))", "reason": "FieldValueRequired", "fieldPath": ".o['a']"},
                {"rule": "!has(self.s) || self.s != 'y'", "messageExpression": "''", "message": "fallback"}]}}}));
        let obj = json!({"spec": {"n": 0, "s": "x", "o": {}}});
        let (errs, _) = s.validate(&obj, None);
        let text: Vec<String> = errs.iter().map(ToString::to_string).collect();
        assert_eq!(text, [
            "spec: Invalid value: failed rule: !has(self.n) || self.n > 0",
            "spec.s: Forbidden: s must not be x",
            "spec.o.a: Required value: o needs a, has 0",
        ]);
        let (errs, _) = s.validate(&json!({"spec": {"s": "y"}}), None);
        assert_eq!(errs[0].to_string(), "spec: Invalid value: fallback");
    }

    #[test]
    fn scalars_show_their_value_and_runtime_errors_the_type() {
        let s = crd(json!({"type": "object", "x-kubernetes-validations": [{"rule": "self.spec.missing == 1"}],
            "properties": {"spec": {"type": "object", "properties": {
                "n": {"type": "integer", "x-kubernetes-validations": [{"rule": "self >= 1", "message": "n must be >= 1"}]},
                "s": {"type": "string", "x-kubernetes-validations": [{"rule": "self in ['a', 'b']"}]}}}}}));
        let (errs, _) = s.validate(&json!({"spec": {"n": 0, "s": "c"}}), None);
        let text: Vec<String> = errs.iter().map(ToString::to_string).collect();
        assert_eq!(text, [
            "<nil>: Invalid value: \"object\": no such key: missing evaluating rule: self.spec.missing == 1",
            "spec.n: Invalid value: 0: n must be >= 1",
            "spec.s: Invalid value: \"c\": failed rule: self in ['a', 'b']",
        ]);
    }

    #[test]
    fn transition_rules_see_the_old_value_of_correlated_items_only() {
        let s = crd(json!({"type": "object", "properties": {"spec": {"type": "object", "properties": {
            "keyed": {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
                "items": {"type": "object", "properties": {"name": {"type": "string"}, "v": {"type": "string",
                    "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "field is immutable"}]}}}},
            "plain": {"type": "array", "items": {"type": "object", "properties": {"v": {"type": "string",
                "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "field is immutable"}]}}}}}}}}));
        let old = json!({"spec": {"keyed": [{"name": "a", "v": "1"}, {"name": "b", "v": "1"}], "plain": [{"v": "1"}]}});
        let new = json!({"spec": {"keyed": [{"name": "b", "v": "2"}, {"name": "c", "v": "2"}], "plain": [{"v": "2"}]}});
        assert!(s.validate(&new, None).0.is_empty(), "transition rules ran on create");
        let (errs, _) = s.validate(&new, Some(&old));
        let text: Vec<String> = errs.iter().map(ToString::to_string).collect();
        assert_eq!(text, ["spec.keyed[0].v: Invalid value: \"2\": field is immutable"]);
    }

    #[test]
    fn failures_on_unchanged_values_are_ratcheted() {
        let s = crd(json!({"type": "object", "properties": {"spec": {"type": "object", "properties": {
            "a": {"type": "string", "x-kubernetes-validations": [{"rule": "self != 'bad'"}]},
            "b": {"type": "string", "x-kubernetes-validations": [{"rule": "self != 'bad'"}]}}}}}));
        let old = json!({"spec": {"a": "bad", "b": "ok"}});
        let new = json!({"spec": {"a": "bad", "b": "bad"}});
        let (errs, warnings) = s.validate(&new, Some(&old));
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].path, "spec.b");
        assert_eq!(warnings.len(), 1);
        assert_eq!(warnings[0].path, "spec.a");
    }

    #[test]
    fn set_and_map_lists_compare_regardless_of_order() {
        let s = crd(json!({"type": "object", "properties": {"spec": {"type": "object",
            "x-kubernetes-validations": [{"rule": "self == oldSelf"}],
            "properties": {"tags": {"type": "array", "x-kubernetes-list-type": "set", "items": {"type": "string"}},
                "cmd": {"type": "array", "items": {"type": "string"}}}}}}));
        let old = json!({"spec": {"tags": ["a", "b"], "cmd": ["x", "y"]}});
        assert!(s.validate(&json!({"spec": {"tags": ["b", "a"], "cmd": ["x", "y"]}}), Some(&old)).0.is_empty());
        assert_eq!(s.validate(&json!({"spec": {"tags": ["a", "b"], "cmd": ["y", "x"]}}), Some(&old)).0.len(), 1);
    }

    #[test]
    fn unknown_fields_are_pruned_and_named() {
        let s = crd(json!({"type": "object", "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
            "metadata": {"type": "object"}, "spec": {"type": "object", "properties": {
                "env": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}}}},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}}}}}}));
        let mut obj = json!({"metadata": {"name": "x", "labels": {"a": "b"}, "colour": "red"},
            "spec": {"foo": 1, "env": [{"name": "A", "value": "1"}], "labels": {"any": "thing"}}, "extra": true});
        let unknown = s.prune(&mut obj);
        assert_eq!(unknown, ["extra", "spec.env[0].value", "spec.foo", "metadata.colour"]);
        assert_eq!(obj, json!({"metadata": {"name": "x", "labels": {"a": "b"}},
            "spec": {"env": [{"name": "A"}], "labels": {"any": "thing"}}}));
    }

    #[test]
    fn defaults_are_applied_and_stray_nulls_dropped() {
        let s = crd(json!({"type": "object", "properties": {"spec": {"type": "object", "properties": {
            "kind": {"type": "string", "default": "Cluster"}, "n": {"type": "integer"},
            "items": {"type": "array", "items": {"type": "object", "properties": {"replicas": {"type": "integer", "default": 1}}}}}}}}));
        let mut obj = json!({"spec": {"n": null, "items": [{}, {"replicas": 3}]}});
        s.default(&mut obj);
        assert_eq!(obj, json!({"spec": {"kind": "Cluster", "items": [{"replicas": 1}, {"replicas": 3}]}}));
    }

    #[test]
    fn field_paths_normalize() {
        assert_eq!(normalize_field_path(".a.b"), "a.b");
        assert_eq!(normalize_field_path(".a['b.c']"), "a.b.c");
        assert_eq!(normalize_field_path(".a[b]"), "a.b");
    }
}
