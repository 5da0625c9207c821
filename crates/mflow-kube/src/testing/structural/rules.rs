//! The CEL side: the rules compiled, run against a view of the object, and their errors.

use super::*;

#[derive(Default)]
pub(super) struct Outcome {
    pub(super) errors: Vec<FieldError>,
    pub(super) ratcheted: Vec<FieldError>,
}

/// cel-go's wording of the runtime errors the server quotes.
pub(super) fn runtime_error(e: &ExecutionError) -> String {
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
    pub(super) fn parse(spec: &Value, at: &str, failed: &mut Vec<String>) -> Option<Rule> {
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
    pub(super) fn error_string(&self) -> String {
        self.message.clone().unwrap_or_else(|| self.source.trim().to_string())
    }

    /// `ruleMessageOrDefault`.
    pub(super) fn message_or_default(&self) -> String {
        self.message.clone().unwrap_or_else(|| format!("failed rule: {}", self.source.trim()))
    }
}

pub(super) fn compile(source: &str) -> Result<Program, String> {
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
pub(super) fn normalize_field_path(path: &str) -> String {
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

/// The object as rules on the root see it: of its metadata, only name and generateName.
pub(super) fn root_view(node: &Node, obj: &Value) -> Cel {
    let mut obj = obj.clone();
    if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.retain(|k, _| k == "name" || k == "generateName");
    }
    to_cel(node, &obj)
}

/// Kubernetes' escaping of property names that are not CEL identifiers. Keywords stay as they
/// are: the runtime CRDs' own rules select `metadata.namespace` as written.
pub(super) fn escape(name: &str) -> String {
    if !name.contains(['.', '-', '/']) && !name.contains("__") {
        return name.to_string();
    }
    name.replace("__", "__underscores__").replace('.', "__dot__").replace('-', "__dash__").replace('/', "__slash__")
}

pub(super) fn to_cel(node: &Node, value: &Value) -> Cel {
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
