//! Declarative field tables. One table per section and stage kind drives three things: validation
//! (unknown keys, types, required keys, defaults), the JSON Schema printed by `mflow schema`, and the
//! key reference in docs/spec.md. Adding a parameter means adding one line here.

use serde_json::{json, Map, Value as Json};

use super::error::{did_you_mean, to_span, SpecError, Src};
use super::tree::{Node, Val};

#[derive(Debug, Clone, Copy)]
pub enum Ty {
    Str,
    Int,
    /// An integer from `.0` to `.1`, both included.
    IntIn(i64, i64),
    /// An integer is accepted too.
    Float,
    /// A number at least `.0` and below `.1` (which may be infinity).
    FloatIn(f64, f64),
    Bool,
    StrList,
    /// A list of strings or numbers (free form, e.g. split ratios).
    List,
    /// "5s", "10m", "1h30m"
    Duration,
    /// A [`Ty::Duration`] above zero: a limit of nothing would end everything at once.
    Timeout,
    Enum(&'static [&'static str]),
    /// A table of string values (gates).
    StrMap,
    /// Environment variables: a [`Ty::StrMap`] whose names are letters, digits and `_` (what
    /// every shell, execve and Kubernetes take) and whose values hold no NUL byte and fit
    /// [`MAX_ENV_ENTRY`] and [`MAX_ENV_TOTAL`]. `.0` says why a name is not the spec's to set
    /// (mflow or Kubernetes sets it), or `None`.
    Env(fn(&str) -> Option<String>),
    /// A nested table with its own fields.
    Table(&'static [Field]),
    /// A string, or an integer.
    StrOrInt,
    /// A string that `check` takes: `Some((reason, help))` refuses it when the spec is read.
    Checked(fn(&str) -> Option<(String, String)>),
}

/// Longest `NAME=value` of an environment, in bytes: Linux's execve(2) refuses a longer string
/// (MAX_ARG_STRLEN, 128 KiB), so the stage could never start, locally or in a pod.
pub const MAX_ENV_ENTRY: usize = 128 << 10;
/// Most bytes of one environment table: a TrainJob carries it, and JobSet copies it into the
/// JobSet, its Jobs and each pod, every one of them held to etcd's 1.5 MiB per object beside
/// the rest of the object; a process's arguments and environment also share ARG_MAX.
pub const MAX_ENV_TOTAL: usize = 512 << 10;

/// An integer >= 0 (counts that may be none, seeds).
pub const NATURAL: Ty = Ty::IntIn(0, i64::MAX);
/// An integer >= 1.
pub const COUNT: Ty = Ty::IntIn(1, i64::MAX);
/// A number >= 0.
pub const NON_NEGATIVE: Ty = Ty::FloatIn(0.0, f64::INFINITY);

#[derive(Debug, Clone, Copy)]
pub struct Field {
    pub name: &'static str,
    pub ty: Ty,
    pub required: bool,
    /// The default as JSON text; `None` means "absent unless given".
    pub default: Option<&'static str>,
    pub doc: &'static str,
}

pub const fn req(name: &'static str, ty: Ty, doc: &'static str) -> Field {
    Field { name, ty, required: true, default: None, doc }
}

pub const fn opt(name: &'static str, ty: Ty, doc: &'static str) -> Field {
    Field { name, ty, required: false, default: None, doc }
}

pub const fn def(name: &'static str, ty: Ty, default: &'static str, doc: &'static str) -> Field {
    Field { name, ty, required: false, default: Some(default), doc }
}

/// Checks `node` (a table) against `fields` and returns the typed values with defaults filled
/// in. Problems go to `errors`; the returned map then holds what could be read.
pub fn check_table(
    src: &Src,
    node: &Node,
    fields: &[Field],
    table: &str,
    errors: &mut Vec<SpecError>,
) -> Map<String, Json> {
    let mut out = Map::new();
    let Some(entries) = node.as_table() else {
        errors.push(wrong_type(src, node, table, "a table"));
        return out;
    };
    for (key, value) in entries {
        match fields.iter().find(|f| f.name == key.name) {
            None => errors.push(SpecError::UnknownKey {
                src: src.clone(),
                span: to_span(key.origin.span()),
                key: crate::spec::error::excerpt(&key.name),
                table: table.to_string(),
                help: did_you_mean(&key.name, &fields.iter().map(|f| f.name).collect::<Vec<_>>(), "keys"),
            }),
            Some(field) => {
                // A nested table is named in backticks for messages; its keys are not.
                if let Some(v) =
                    check_value(src, value, field, &format!("{}.{}", table.trim_matches('`'), key.name), errors)
                {
                    out.insert(field.name.to_string(), v);
                }
            }
        }
    }
    for field in fields {
        if (!field.required && field.default.is_none()) || out.contains_key(field.name) {
            continue;
        }
        if field.required && !entries.iter().any(|(k, _)| k.name == field.name) {
            errors.push(SpecError::MissingKey {
                src: src.clone(),
                span: to_span(node.span().map(|r| r.start..r.start.max(r.end.min(r.start + 1)))),
                key: field.name.to_string(),
                table: table.to_string(),
                help: format!("add `{} = ...`: {}", field.name, field.doc),
            });
        } else if let Some(d) = field.default {
            out.insert(field.name.to_string(), default_value(d));
        }
    }
    out
}

/// A field's default, parsed once per process: every stage of a large spec asks for the same few.
fn default_value(d: &'static str) -> Json {
    thread_local! {
        static PARSED: std::cell::RefCell<std::collections::HashMap<&'static str, Json>> = Default::default();
    }
    PARSED.with(|p| p.borrow_mut().entry(d).or_insert_with(|| serde_json::from_str(d).expect("valid default")).clone())
}

fn wrong_type(src: &Src, node: &Node, key: &str, expected: &str) -> SpecError {
    SpecError::WrongType {
        src: src.clone(),
        span: to_span(node.span()),
        key: key.to_string(),
        expected: expected.to_string(),
        found: node.value.type_name().to_string(),
        help: match &node.origin {
            super::tree::Origin::Override(arg) => format!("from `--set {arg}`"),
            _ => format!("write `{}` as {expected}", key.rsplit('.').next().unwrap_or(key)),
        },
    }
}

pub fn invalid(src: &Src, node: &Node, key: &str, reason: impl Into<String>, help: impl Into<String>) -> SpecError {
    SpecError::InvalidValue {
        src: src.clone(),
        span: to_span(node.span()),
        key: key.to_string(),
        reason: reason.into(),
        help: help.into(),
    }
}

fn check_value(src: &Src, node: &Node, field: &Field, key: &str, errors: &mut Vec<SpecError>) -> Option<Json> {
    let v = &node.value;
    let ok = match (field.ty, v) {
        (Ty::Str, Val::Str(s)) => Some(Json::String(s.clone())),
        (Ty::Int, Val::Int(i)) => Some(Json::from(*i)),
        (Ty::Float, Val::Int(i)) => Some(Json::from(*i as f64)),
        // nan and inf are TOML numbers, but no setting of a spec means them.
        (Ty::Float | Ty::FloatIn(..), Val::Float(f)) if !f.is_finite() => {
            errors.push(invalid(
                src,
                node,
                key,
                format!("{f} is not a finite number"),
                "write an ordinary number such as 4 or 0.5",
            ));
            return None;
        }
        (Ty::Float, Val::Float(_)) => Some(v.to_json()),
        (Ty::IntIn(..) | Ty::FloatIn(..), Val::Int(_) | Val::Float(_)) => {
            return in_range(src, node, field.ty, key, errors)
        }
        (Ty::Bool, Val::Bool(b)) => Some(Json::Bool(*b)),
        (Ty::StrOrInt, Val::Str(_) | Val::Int(_)) => Some(v.to_json()),
        (Ty::Checked(check), Val::Str(s)) => match check(s) {
            None => Some(Json::String(s.clone())),
            Some((reason, help)) => {
                errors.push(invalid(src, node, key, reason, help));
                return None;
            }
        },
        (Ty::StrList, Val::Array(items)) => {
            let mut list = Vec::new();
            for item in items {
                match &item.value {
                    Val::Str(s) => list.push(Json::String(s.clone())),
                    _ => {
                        errors.push(wrong_type(src, item, &format!("{key}[]"), "a string"));
                        return None;
                    }
                }
            }
            Some(Json::Array(list))
        }
        (Ty::List, Val::Array(_)) => Some(v.to_json()),
        (Ty::Duration | Ty::Timeout, Val::Str(s)) => match humantime::parse_duration(s) {
            Ok(d) if d.is_zero() && matches!(field.ty, Ty::Timeout) => {
                errors.push(invalid(
                    src,
                    node,
                    key,
                    "zero: every attempt would end at once",
                    "give a positive duration, or leave the key out for no limit",
                ));
                return None;
            }
            Ok(_) => Some(Json::String(s.clone())),
            Err(e) => {
                errors.push(invalid(
                    src,
                    node,
                    key,
                    format!("not a duration ({e})"),
                    "write a duration such as \"30s\", \"10m\" or \"1h30m\"",
                ));
                return None;
            }
        },
        (Ty::Enum(choices), Val::Str(s)) => {
            if choices.contains(&s.as_str()) {
                Some(Json::String(s.clone()))
            } else {
                errors.push(invalid(
                    src,
                    node,
                    key,
                    format!("`{s}` is not one of {}", choices.join(", ")),
                    did_you_mean(s, choices, "values"),
                ));
                return None;
            }
        }
        (Ty::StrMap | Ty::Env(_), Val::Table(entries)) => {
            if let Ty::Env(reserved) = field.ty {
                if !env_ok(src, node, reserved, key, errors) {
                    return None;
                }
            }
            let mut m = Map::new();
            for (k, item) in entries {
                match &item.value {
                    Val::Str(s) => {
                        m.insert(k.name.clone(), Json::String(s.clone()));
                    }
                    Val::Int(_) | Val::Float(_) | Val::Bool(_) => {
                        m.insert(k.name.clone(), Json::String(item.value.to_json().to_string()));
                    }
                    _ => {
                        errors.push(wrong_type(src, item, &format!("{key}.{}", k.name), "a string"));
                        return None;
                    }
                }
            }
            Some(Json::Object(m))
        }
        (Ty::Table(fields), Val::Table(_)) => {
            Some(Json::Object(check_table(src, node, fields, &format!("`{key}`"), errors)))
        }
        _ => None,
    };
    if ok.is_none() {
        errors.push(wrong_type(src, node, key, expected(field.ty)));
    }
    ok
}

/// Whether a name is one every shell, execve(2) and Kubernetes take as an environment
/// variable's: `=` would end the name early (and let `MFLOW_OUTPUT=x` past the contract's own).
pub fn env_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Checks the names and values of an environment table; false when something is refused.
fn env_ok(
    src: &Src,
    table: &Node,
    reserved: fn(&str) -> Option<String>,
    key: &str,
    errors: &mut Vec<SpecError>,
) -> bool {
    let before = errors.len();
    let Some(entries) = table.as_table() else { return true };
    let mut total = 0;
    for (k, item) in entries {
        let at = format!("{key}.{}", super::error::excerpt(&k.name));
        let at_name = |reason: String, help: &str| SpecError::InvalidValue {
            src: src.clone(),
            span: to_span(k.origin.span()),
            key: at.clone(),
            reason,
            help: help.into(),
        };
        // `NAME=value` and its NUL, as execve counts it.
        let entry = k.name.len()
            + 2
            + match &item.value {
                Val::Str(s) => s.len(),
                other => other.to_json().to_string().len(),
            };
        total += entry;
        if !env_name(&k.name) {
            let help = "use letters, digits and `_`, not starting with a digit";
            errors.push(at_name("not an environment variable name".into(), help));
        } else if let Some(why) = reserved(&k.name) {
            errors.push(at_name(why, "remove it: the value that variable holds is not the spec's to set"));
        } else if super::secret::credential_name(&k.name) {
            // No span: the excerpt under a label would print the credential's line.
            let place = match &item.origin {
                super::tree::Origin::File(r) => format!(" (line {})", src.inner()[..r.start].matches('\n').count() + 1),
                super::tree::Origin::Override(arg) => format!(" (from `--set {arg}`)"),
            };
            errors.push(SpecError::InvalidValue {
                src: src.clone(),
                span: None,
                key: at,
                reason: format!("a credential cannot be given in a spec{place}"),
                help: format!(
                    "a spec's values are kept in the run's lockfile, records and plans; set {} in mflow's own \
                     environment instead, which local stages inherit",
                    k.name
                ),
            });
        } else if matches!(&item.value, Val::Str(s) if s.contains('\0')) {
            errors.push(invalid(
                src,
                item,
                &at,
                "holds a NUL byte",
                "no process can be given an environment value with a NUL byte in it",
            ));
        } else if entry > MAX_ENV_ENTRY {
            let reason = format!("{entry} bytes with its name; a process takes at most 128 KiB per variable");
            errors.push(invalid(src, item, &at, reason, "pass large data as a file (an input) and its path here"));
        }
    }
    if total > MAX_ENV_TOTAL && errors.len() == before {
        let reason = format!("{total} bytes in all; an environment table may hold at most 512 KiB");
        let help = "pass large data as files (inputs) and their paths here: on Kubernetes the environment \
                    travels in every object mflow creates for it, each held to etcd's 1.5 MiB";
        errors.push(invalid(src, table, key, reason, help));
    }
    errors.len() == before
}

/// A number of a field with bounds, when it lies inside them.
fn in_range(src: &Src, node: &Node, ty: Ty, key: &str, errors: &mut Vec<SpecError>) -> Option<Json> {
    let (ok, words, value) = match (ty, &node.value) {
        (Ty::IntIn(lo, hi), Val::Int(i)) => ((lo..=hi).contains(i), int_range(lo, hi), Json::from(*i)),
        (Ty::FloatIn(lo, below), Val::Int(i)) => {
            (*i as f64 >= lo && (*i as f64) < below, float_range(lo, below), Json::from(*i as f64))
        }
        (Ty::FloatIn(lo, below), Val::Float(x)) => (*x >= lo && *x < below, float_range(lo, below), Json::from(*x)),
        _ => {
            errors.push(wrong_type(src, node, key, expected(ty)));
            return None;
        }
    };
    if ok {
        return Some(value);
    }
    let name = key.rsplit('.').next().unwrap_or(key);
    errors.push(invalid(src, node, key, format!("{value} is not {words}"), format!("set `{name}` to {words}")));
    None
}

/// `an integer >= 1`, `an integer from 0 to 9`: what an integer field takes, in words.
fn int_range(lo: i64, hi: i64) -> String {
    match hi {
        i64::MAX => format!("an integer >= {lo}"),
        _ => format!("an integer from {lo} to {hi}"),
    }
}

fn float_range(lo: f64, below: f64) -> String {
    match below {
        f64::INFINITY => format!("a number >= {lo}"),
        _ => format!("a number >= {lo} and below {below}"),
    }
}

fn expected(ty: Ty) -> &'static str {
    match ty {
        Ty::Str => "a string",
        Ty::Int | Ty::IntIn(..) => "an integer",
        Ty::Float | Ty::FloatIn(..) => "a number",
        Ty::Bool => "a boolean",
        Ty::StrList => "an array of strings",
        Ty::List => "an array",
        Ty::Duration => "a duration string",
        Ty::Timeout => "a duration string above zero",
        Ty::Enum(_) => "a string",
        Ty::StrMap => "a table of strings",
        Ty::Env(_) => "a table of environment variables",
        Ty::Table(_) => "a table",
        Ty::StrOrInt => "a string or an integer",
        Ty::Checked(_) => "a string",
    }
}

/// JSON Schema of one field table.
pub fn json_schema(fields: &[Field]) -> Json {
    let mut props = Map::new();
    let mut required = Vec::new();
    for f in fields {
        let mut s = ty_schema(f.ty);
        s["description"] = Json::String(f.doc.to_string());
        if let Some(d) = f.default {
            s["default"] = serde_json::from_str(d).expect("valid default");
        }
        props.insert(f.name.to_string(), s);
        if f.required {
            required.push(Json::String(f.name.to_string()));
        }
    }
    json!({"type": "object", "additionalProperties": false, "properties": props, "required": required})
}

fn ty_schema(ty: Ty) -> Json {
    match ty {
        Ty::Str => json!({"type": "string"}),
        Ty::Int => json!({"type": "integer"}),
        Ty::IntIn(lo, hi) if hi == i64::MAX => json!({"type": "integer", "minimum": lo}),
        Ty::IntIn(lo, hi) => json!({"type": "integer", "minimum": lo, "maximum": hi}),
        Ty::Float => json!({"type": "number"}),
        Ty::FloatIn(lo, below) if below == f64::INFINITY => json!({"type": "number", "minimum": lo}),
        Ty::FloatIn(lo, below) => json!({"type": "number", "minimum": lo, "exclusiveMaximum": below}),
        Ty::Bool => json!({"type": "boolean"}),
        Ty::StrList => json!({"type": "array", "items": {"type": "string"}}),
        Ty::List => json!({"type": "array"}),
        Ty::Duration | Ty::Timeout => json!({"type": "string", "pattern": "^([0-9]+(ms|s|m|h|d) *)+$"}),
        Ty::Enum(c) => json!({"type": "string", "enum": c}),
        Ty::StrMap => json!({"type": "object", "additionalProperties": {"type": ["string", "number", "boolean"]}}),
        Ty::Env(_) => json!({
            "type": "object",
            "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
            "additionalProperties": {"type": ["string", "number", "boolean"]}
        }),
        Ty::Table(f) => json_schema(f),
        Ty::StrOrInt => json!({"type": ["string", "integer"]}),
        Ty::Checked(_) => json!({"type": "string"}),
    }
}

/// A Markdown table of one field table, for docs/spec.md.
pub fn markdown(fields: &[Field]) -> String {
    let mut out = String::from("| key | type | default | |\n|---|---|---|---|\n");
    for f in fields {
        let ty = match f.ty {
            Ty::Enum(c) => c.iter().map(|c| format!("`{c}`")).collect::<Vec<_>>().join(" \\| "),
            Ty::Table(_) => "table (below)".into(),
            Ty::IntIn(lo, hi) => int_range(lo, hi).trim_start_matches("an ").to_string(),
            Ty::FloatIn(lo, below) => float_range(lo, below).trim_start_matches("a ").to_string(),
            other => expected(other).trim_start_matches("a ").trim_start_matches("an ").to_string(),
        };
        let default = match (f.required, f.default) {
            (true, _) => "required".to_string(),
            (false, Some(d)) => format!("`{d}`"),
            (false, None) => String::new(),
        };
        out.push_str(&format!("| `{}` | {ty} | {default} | {} |\n", f.name, f.doc.replace('|', "\\|")));
    }
    out
}
