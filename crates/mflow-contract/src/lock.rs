//! mflow.lock: what makes a run reproducible. A lockfile holds nothing that changes from run to
//! run by itself (no time, no run id), so two runs that locked the same things have the same
//! lockfile. It also defines the cache key: how a key is derived from its parts.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

/// The format of mflow.lock, in its `version` field.
pub const FORMAT: u32 = 1;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Lockfile {
    /// The format of this file ([`FORMAT`]).
    pub version: u32,
    pub mflow_version: String,
    pub pipeline: String,
    pub spec: String,
    pub spec_digest: String,
    pub git_commit: Option<String>,
    pub overrides: Vec<String>,
    pub environment: BTreeMap<String, String>,
    pub stages: BTreeMap<String, LockedStage>,
}

/// Per stage in the lockfile.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LockedStage {
    pub kind: String,
    pub key: String,
    pub parts: Arc<KeyParts>,
    pub output_digest: Option<String>,
}

/// Everything that determines a stage's output. The key is blake3 over a canonical,
/// length-prefixed encoding of these parts; the parts are kept so that `mflow why` can say
/// which one changed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyParts {
    pub kind: String,
    pub kind_version: u32,
    /// Resolved parameters, canonical (sorted keys). Shared: every stage's parts are copied
    /// once per upstream digest they wait for, and parameters are most of their size.
    pub params: Arc<Json>,
    /// Upstream stage name -> digest of its committed output.
    pub upstream: BTreeMap<String, String>,
    /// Input file (relative to the spec) -> content digest. Shared, as `params` is.
    pub inputs: Arc<BTreeMap<String, String>>,
    /// Digest of the workload code the stage runs.
    pub workload: String,
    /// Digest of the environment (Python lock, tool versions).
    pub environment: String,
    pub salt: String,
}

impl KeyParts {
    pub fn key(&self) -> String {
        self.key_given(&canonical(&self.params))
    }

    /// The key, given `canonical(&self.params)` (planning encodes it once per stage).
    pub fn key_given(&self, params: &str) -> String {
        // Encoded into one buffer and hashed once: many small hasher updates cost more than
        // the hashing itself.
        let mut buf = Vec::with_capacity(1024);
        let mut field = |tag: &str, bytes: &[u8]| {
            buf.extend_from_slice(&(tag.len() as u64).to_le_bytes());
            buf.extend_from_slice(tag.as_bytes());
            buf.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            buf.extend_from_slice(bytes);
        };
        field("mflow-key", b"1");
        field("kind", self.kind.as_bytes());
        field("kind_version", &self.kind_version.to_le_bytes());
        field("params", params.as_bytes());
        for (name, digest) in &self.upstream {
            field("upstream", name.as_bytes());
            field("digest", digest.as_bytes());
        }
        for (path, digest) in self.inputs.iter() {
            field("input", path.as_bytes());
            field("digest", digest.as_bytes());
        }
        field("workload", self.workload.as_bytes());
        field("environment", self.environment.as_bytes());
        field("salt", self.salt.as_bytes());
        blake3::hash(&buf).to_hex().to_string()
    }
}

/// JSON with object keys sorted at every level, no whitespace; written directly rather than
/// through a sorted copy of the tree (this runs for every stage of every plan).
pub fn canonical(v: &Json) -> String {
    fn write(v: &Json, out: &mut Vec<u8>) {
        match v {
            Json::Object(m) => {
                let mut entries: Vec<(&String, &Json)> = m.iter().collect();
                entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
                out.push(b'{');
                for (i, (k, v)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    serde_json::to_writer(&mut *out, k).expect("JSON serializes");
                    out.push(b':');
                    write(v, out);
                }
                out.push(b'}');
            }
            Json::Array(a) => {
                out.push(b'[');
                for (i, v) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    write(v, out);
                }
                out.push(b']');
            }
            scalar => serde_json::to_writer(&mut *out, scalar).expect("JSON serializes"),
        }
    }
    let mut out = Vec::new();
    write(v, &mut out);
    String::from_utf8(out).expect("JSON is UTF-8")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
    fn key_ignores_key_order_but_not_values() {
        let a = parts();
        let mut b = parts();
        b.params = Arc::new(json!({"a": [1, 2], "b": 1}));
        assert_eq!(a.key(), b.key());
        b.params = Arc::new(json!({"a": [2, 1], "b": 1}));
        assert_ne!(a.key(), b.key());
        let mut c = parts();
        c.salt = "x".into();
        assert_ne!(a.key(), c.key());
    }

    /// The encoding is part of the cache format: a change here orphans every cache entry.
    /// The expected key was computed independently (Python's blake3 over the same encoding).
    #[test]
    fn key_encoding_is_stable() {
        assert_eq!(parts().key(), "bcde5be1fa6a20c0cca43add7d2c86e9bafbca3e53d0a4c7abe739731b14e158");
    }

    #[test]
    fn canonical_sorts_keys_at_every_level() {
        let v = json!({"b": [{"y": "\"q\"", "x": 1.5}], "a": {"d": null, "c": true}});
        assert_eq!(canonical(&v), r#"{"a":{"c":true,"d":null},"b":[{"x":1.5,"y":"\"q\""}]}"#);
    }

    #[test]
    fn fields_are_length_prefixed() {
        let mut a = parts();
        a.workload = "ab".into();
        a.environment = "c".into();
        let mut b = parts();
        b.workload = "a".into();
        b.environment = "bc".into();
        assert_ne!(a.key(), b.key());
    }
}
