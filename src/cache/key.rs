//! Cache keys: blake3 over a canonical, length-prefixed encoding of everything that determines
//! a stage's output. The parts are kept so that `mflow why` can say which one changed.

use std::collections::BTreeMap;

use serde_json::Value as Json;

pub use mflow_contract::lock::{canonical, KeyParts};

/// Human-readable differences of a key's parts from an earlier key's.
pub fn diff(new: &KeyParts, old: &KeyParts) -> Vec<String> {
    let mut out = Vec::new();
    if new.kind != old.kind || new.kind_version != old.kind_version {
        out.push(format!("stage kind: {} v{} -> {} v{}", old.kind, old.kind_version, new.kind, new.kind_version));
    }
    diff_json("parameter", "", &old.params, &new.params, &mut out);
    diff_maps("upstream output", &old.upstream, &new.upstream, &mut out);
    diff_maps("input file", &old.inputs, &new.inputs, &mut out);
    if new.workload != old.workload {
        out.push(format!("workload code: {} -> {}", short(&old.workload), short(&new.workload)));
    }
    if new.environment != old.environment {
        out.push(format!("environment: {} -> {}", short(&old.environment), short(&new.environment)));
    }
    if new.salt != old.salt {
        out.push(format!("salt: {:?} -> {:?}", old.salt, new.salt));
    }
    out
}

/// blake3 over length-prefixed parts, so that no two different lists of parts share a digest.
#[derive(Default)]
pub struct PartsHasher(blake3::Hasher);

impl PartsHasher {
    pub fn part(&mut self, bytes: &[u8]) -> &mut PartsHasher {
        self.0.update(&(bytes.len() as u64).to_le_bytes());
        self.0.update(bytes);
        self
    }

    pub fn hex(&self) -> String {
        self.0.finalize().to_hex().to_string()
    }
}

pub fn short(d: &str) -> &str {
    // By characters: a lockfile's values may be any text.
    &d[..d.char_indices().nth(12).map_or(d.len(), |(i, _)| i)]
}

fn diff_maps(what: &str, old: &BTreeMap<String, String>, new: &BTreeMap<String, String>, out: &mut Vec<String>) {
    for (k, v) in new {
        match old.get(k) {
            None => out.push(format!("{what} `{k}`: added")),
            Some(o) if o != v => out.push(format!("{what} `{k}`: {} -> {}", short(o), short(v))),
            _ => {}
        }
    }
    for k in old.keys().filter(|k| !new.contains_key(*k)) {
        out.push(format!("{what} `{k}`: removed"));
    }
}

fn diff_json(what: &str, path: &str, old: &Json, new: &Json, out: &mut Vec<String>) {
    match (old, new) {
        (Json::Object(a), Json::Object(b)) => {
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for k in keys {
                let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                match (a.get(k), b.get(k)) {
                    (Some(x), Some(y)) => diff_json(what, &p, x, y, out),
                    (None, Some(y)) => out.push(format!("{what} `{p}`: added ({y})")),
                    (Some(x), None) => out.push(format!("{what} `{p}`: removed (was {x})")),
                    (None, None) => {}
                }
            }
        }
        (a, b) if a != b => out.push(format!("{what} `{path}`: {a} -> {b}")),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::sync::Arc;

    fn parts() -> KeyParts {
        KeyParts {
            kind: "command".into(),
            kind_version: 1,
            params: Arc::new(json!({"b": 1, "a": [1, 2]})),
            upstream: BTreeMap::from([("up".into(), "d1".into())]),
            inputs: Arc::default(),
            workload: String::new(),
            environment: String::new(),
            salt: String::new(),
        }
    }

    #[test]
    fn diff_names_what_changed() {
        let a = parts();
        let mut b = parts();
        b.params = Arc::new(json!({"b": 2, "a": [1, 2]}));
        b.upstream.insert("up".into(), "d2".into());
        let d = diff(&b, &a);
        assert_eq!(d, vec!["parameter `b`: 1 -> 2".to_string(), "upstream output `up`: d1 -> d2".to_string()]);
    }
}
