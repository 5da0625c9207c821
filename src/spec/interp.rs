//! `${vars.NAME}` and `${stages.NAME.output}` references inside string values.

use std::collections::BTreeMap;

use super::error::{did_you_mean, to_span, SpecError, Src};
use super::schema::invalid;
use super::tree::{Node, Val};

/// One piece of an interpolated string.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text(String),
    Var(String),
    StageOutput(String),
}

/// Splits `s` into pieces. `$${` is a literal `${`. Returns the malformed reference on error.
pub fn pieces(s: &str) -> Result<Vec<Piece>, String> {
    let mut out = Vec::new();
    let mut text = String::new();
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        text.push_str(&rest[..i]);
        let after = &rest[i..];
        if let Some(tail) = after.strip_prefix("$${") {
            text.push_str("${");
            rest = tail;
        } else if after.starts_with("${") {
            let end = after.find('}').ok_or_else(|| after.to_string())?;
            let inner = &after[2..end];
            let piece = parse_ref(inner).ok_or_else(|| after[..=end].to_string())?;
            if !text.is_empty() {
                out.push(Piece::Text(std::mem::take(&mut text)));
            }
            out.push(piece);
            rest = &after[end + 1..];
        } else {
            text.push('$');
            rest = &after[1..];
        }
    }
    text.push_str(rest);
    if !text.is_empty() {
        out.push(Piece::Text(text));
    }
    Ok(out)
}

/// Whether `s` may hold a reference: most strings do not, and skip the parse.
pub fn has_refs(s: &str) -> bool {
    s.contains("${")
}

fn parse_ref(inner: &str) -> Option<Piece> {
    let parts: Vec<&str> = inner.split('.').collect();
    let ident = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    match parts.as_slice() {
        ["vars", name] if ident(name) => Some(Piece::Var(name.to_string())),
        ["stages", name, "output"] if ident(name) => Some(Piece::StageOutput(name.to_string())),
        _ => None,
    }
}

/// Stage names referenced by `${stages.X.output}` anywhere in a JSON value.
pub fn stage_refs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::String(s) if has_refs(s) => {
            if let Ok(ps) = pieces(s) {
                for p in ps {
                    if let Piece::StageOutput(n) = p {
                        out.push(n);
                    }
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| stage_refs(x, out)),
        serde_json::Value::Object(m) => m.values().for_each(|x| stage_refs(x, out)),
        _ => {}
    }
}

/// Replaces `${stages.X.output}` with `resolve(X)` in every string of a JSON value.
pub fn substitute_outputs(v: &serde_json::Value, resolve: &dyn Fn(&str) -> String) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        J::String(s) if has_refs(s) => match pieces(s) {
            Ok(ps) => J::String(
                ps.into_iter()
                    .map(|p| match p {
                        Piece::Text(t) => t,
                        Piece::StageOutput(n) => resolve(&n),
                        Piece::Var(n) => format!("${{vars.{n}}}"),
                    })
                    .collect(),
            ),
            Err(_) => v.clone(),
        },
        J::Array(a) => J::Array(a.iter().map(|x| substitute_outputs(x, resolve)).collect()),
        J::Object(m) => J::Object(m.iter().map(|(k, x)| (k.clone(), substitute_outputs(x, resolve))).collect()),
        _ => v.clone(),
    }
}

/// Replaces `${vars.X}` in every string of a stage table. A string that is exactly one
/// reference takes the variable's type; otherwise the variable is formatted into the text.
pub(super) fn interpolate_vars(src: &Src, node: &mut Node, vars: &BTreeMap<String, Node>, errors: &mut Vec<SpecError>) {
    match &mut node.value {
        Val::Str(s) if has_refs(s) => {
            let ps = match pieces(s) {
                Ok(ps) => ps,
                Err(text) => {
                    errors.push(SpecError::Interpolation { src: src.clone(), span: to_span(node.origin.span()), text });
                    return;
                }
            };
            if !ps.iter().any(|p| matches!(p, Piece::Var(_))) {
                return;
            }
            let lookup = |name: &str, errors: &mut Vec<SpecError>| -> Option<Node> {
                let found = vars.get(name).cloned();
                if found.is_none() {
                    let names: Vec<&str> = vars.keys().map(String::as_str).collect();
                    errors.push(SpecError::UnknownVar {
                        src: src.clone(),
                        span: to_span(node.origin.span()),
                        name: name.to_string(),
                        help: did_you_mean(name, &names, "variables"),
                    });
                }
                found
            };
            if let [Piece::Var(name)] = ps.as_slice() {
                if let Some(v) = lookup(name, errors) {
                    node.value = v.value;
                }
                return;
            }
            let mut out = String::new();
            for p in ps {
                match p {
                    Piece::Text(t) => out.push_str(&t),
                    Piece::StageOutput(n) => out.push_str(&format!("${{stages.{n}.output}}")),
                    Piece::Var(name) => match lookup(&name, errors).map(|n| n.value) {
                        Some(Val::Str(s)) => out.push_str(&s),
                        Some(v @ (Val::Int(_) | Val::Float(_) | Val::Bool(_))) => {
                            out.push_str(&v.to_json().to_string())
                        }
                        Some(_) => errors.push(invalid(
                            src,
                            node,
                            &format!("vars.{name}"),
                            "only scalars can be formatted into text",
                            "use the variable as the whole value",
                        )),
                        None => {}
                    },
                }
            }
            node.value = Val::Str(out);
        }
        Val::Array(items) => items.iter_mut().for_each(|n| interpolate_vars(src, n, vars, errors)),
        Val::Table(t) => t.iter_mut().for_each(|(_, n)| interpolate_vars(src, n, vars, errors)),
        _ => {}
    }
}

pub(super) fn collect_stage_refs(
    src: &Src,
    stage: &str,
    node: &Node,
    names: &[&str],
    edges: &mut Vec<(String, String, Option<std::ops::Range<usize>>)>,
    errors: &mut Vec<SpecError>,
) {
    match &node.value {
        Val::Str(s) if has_refs(s) => {
            for p in pieces(s).unwrap_or_default() {
                if let Piece::StageOutput(n) = p {
                    if names.contains(&n.as_str()) {
                        edges.push((stage.to_string(), n, node.span()));
                    } else {
                        errors.push(SpecError::UnknownStage {
                            src: src.clone(),
                            span: to_span(node.span()),
                            stage: stage.to_string(),
                            help: did_you_mean(&n, names, "stages"),
                            name: n,
                        });
                    }
                }
            }
        }
        Val::Array(a) => a.iter().for_each(|n| collect_stage_refs(src, stage, n, names, edges, errors)),
        Val::Table(t) => t.iter().for_each(|(_, n)| collect_stage_refs(src, stage, n, names, edges, errors)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_references_and_escapes() {
        assert_eq!(
            pieces("a ${vars.x} $${b} ${stages.m.output}/c $d").unwrap(),
            vec![
                Piece::Text("a ".into()),
                Piece::Var("x".into()),
                Piece::Text(" ${b} ".into()),
                Piece::StageOutput("m".into()),
                Piece::Text("/c $d".into()),
            ]
        );
        assert!(pieces("${stages.m}").is_err());
        assert!(pieces("${vars.x").is_err());
    }
}
