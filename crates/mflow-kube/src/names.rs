//! Deterministic object names and label values.
//!
//! TrainJob names must be RFC 1035 labels, and JobSet derives pod names
//! `<name>-node-<job>-<rank>-<5 chars>` from them that must fit in 63 characters, which leaves
//! 48 characters for the TrainJob (see docs/kubernetes.md).

use crate::KubeError;

/// Longest TrainJob name mflow generates.
pub const MAX_TRAINJOB_NAME: usize = 48;
/// Longest label value Kubernetes accepts.
pub const MAX_LABEL_VALUE: usize = 63;
/// Longest RFC 1123 label: namespace names, and the pod names JobSet derives.
pub const MAX_DNS_LABEL: usize = 63;
/// Longest RFC 1123 subdomain: ServiceAccount names.
pub const MAX_DNS_SUBDOMAIN: usize = 253;

/// Refuses a namespace name the API server would refuse, saying which rule it breaks.
pub fn check_namespace(name: &str) -> Result<(), KubeError> {
    const HELP: &str = "a namespace name is an RFC 1123 label: at most 63 characters, lower-case letters, digits and `-`, starting and ending with a letter or digit; set `namespace` under [pipeline.kubernetes] (or --namespace) to such a name";
    if name.len() > MAX_DNS_LABEL {
        return Err(KubeError::NameTooLong {
            what: "namespace".into(),
            name: name.into(),
            limit: MAX_DNS_LABEL,
            help: HELP.into(),
        });
    }
    match label_problem(name) {
        Some(problem) => {
            Err(KubeError::InvalidName { what: "namespace".into(), name: name.into(), problem, help: HELP.into() })
        }
        None => Ok(()),
    }
}

/// Refuses a ServiceAccount name the API server would refuse, saying which rule it breaks.
pub fn check_service_account(name: &str) -> Result<(), KubeError> {
    check_subdomain("service account", name, "a ServiceAccount name is an RFC 1123 subdomain: at most 253 characters, lower-case letters, digits, `-` and `.`, each dot-separated part starting and ending with a letter or digit; `kubectl get serviceaccounts` lists those of the namespace")
}

/// Refuses a PersistentVolumeClaim name the API server would refuse: the claim could not exist.
pub fn check_claim(name: &str) -> Result<(), KubeError> {
    check_subdomain("PersistentVolumeClaim", name, "a claim name is an RFC 1123 subdomain: at most 253 characters, lower-case letters, digits, `-` and `.`, each dot-separated part starting and ending with a letter or digit; `kubectl get pvc` lists those of the namespace")
}

/// Refuses a ClusterTrainingRuntime name the API server would refuse: no such runtime can exist.
pub fn check_runtime(name: &str) -> Result<(), KubeError> {
    check_subdomain("ClusterTrainingRuntime", name, "a runtime name is an RFC 1123 subdomain: at most 253 characters, lower-case letters, digits, `-` and `.`, each dot-separated part starting and ending with a letter or digit; `kubectl get clustertrainingruntimes` lists those installed")
}

/// Refuses `name` unless it is an RFC 1123 subdomain, the names of most objects.
fn check_subdomain(what: &str, name: &str, help: &str) -> Result<(), KubeError> {
    if name.len() > MAX_DNS_SUBDOMAIN {
        return Err(KubeError::NameTooLong {
            what: what.into(),
            name: name.into(),
            limit: MAX_DNS_SUBDOMAIN,
            help: help.into(),
        });
    }
    let problem =
        if name.is_empty() { Some("it is empty".to_string()) } else { name.split('.').find_map(label_problem) };
    match problem {
        Some(problem) => {
            Err(KubeError::InvalidName { what: what.into(), name: name.into(), problem, help: help.into() })
        }
        None => Ok(()),
    }
}

/// What keeps `name` from being an RFC 1123 label, length aside.
fn label_problem(name: &str) -> Option<String> {
    if name.is_empty() {
        return Some("it is empty".into());
    }
    if let Some(c) = name.chars().find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')) {
        return Some(format!("{c:?} is not a lower-case letter, digit or `-`"));
    }
    if name.starts_with('-') || name.ends_with('-') {
        return Some("it starts or ends with `-`".into());
    }
    None
}

/// The TrainJob name of one attempt of one stage: `<pipeline>-<stage>-<key8>`, plus `-a<n>` from
/// the second attempt on.
///
/// Parts are lower-cased and reduced to `[a-z0-9-]`. When that changes a part, when the
/// pipeline's name holds a `-` (then `gpt` + `tiny-model` and `gpt-tiny` + `model` would read
/// alike), or when the name would exceed [`MAX_TRAINJOB_NAME`], the parts are shortened and a
/// hash of the original pipeline and stage names is inserted, so distinct stages never share a
/// name: a plain name's last part is 8 characters, a hashed one's 14.
pub fn trainjob_name(pipeline: &str, stage: &str, key: &str, attempt: u32) -> String {
    let key8 = key_prefix(key, 8);
    let suffix = if attempt > 1 { format!("-a{attempt}") } else { String::new() };
    let pipe = dns_part(pipeline);
    let stg = dns_part(stage);
    let altered = pipe != pipeline || stg != stage || pipe.is_empty() || stg.is_empty() || pipe.contains('-');
    let plain = format!("{pipe}-{stg}-{key8}{suffix}");
    if !altered && plain.len() <= MAX_TRAINJOB_NAME && starts_with_letter(&plain) {
        return plain;
    }
    // `<p>-<s>-<h6><key8><suffix>`: the hash keeps altered or truncated names distinct.
    let hash = &blake3::hash(format!("{pipeline}\0{stage}").as_bytes()).to_hex()[..6];
    let fixed = 1 + 6 + key8.len() + suffix.len(); // "-" + hash + key8 + suffix
                                                   // Minus the dash between pipeline and stage, and one character kept for a leading letter.
    let room = MAX_TRAINJOB_NAME - fixed - 2;
    let (p_len, s_len) = split_room(pipe.len(), stg.len(), room);
    let p = trim_dashes(&pipe[..p_len]);
    let s = trim_dashes(&stg[..s_len]);
    let name = [p, s, &format!("{hash}{key8}{suffix}")]
        .iter()
        .filter(|part| !part.is_empty())
        .copied()
        .collect::<Vec<_>>()
        .join("-");
    if starts_with_letter(&name) {
        name
    } else {
        format!("m{name}")
    }
}

/// True when `name` is an RFC 1035 label: starts with a letter, `[a-z0-9-]`, no trailing dash.
pub fn is_rfc1035_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && starts_with_letter(name)
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.ends_with('-')
}

/// A valid label value standing for `value`: the value itself when it is one, otherwise a
/// shortened, cleaned form with a hash of the original.
pub fn label_value(value: &str) -> String {
    let valid = value.len() <= MAX_LABEL_VALUE
        && value.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && value.bytes().next().is_none_or(|b| b.is_ascii_alphanumeric())
        && value.bytes().last().is_none_or(|b| b.is_ascii_alphanumeric());
    if valid {
        return value.to_string();
    }
    let hash = &blake3::hash(value.as_bytes()).to_hex()[..8];
    let cleaned = dns_part(value);
    let head = trim_dashes(&cleaned[..cleaned.len().min(MAX_LABEL_VALUE - 9)]);
    if head.is_empty() {
        hash.to_string()
    } else {
        format!("{head}-{hash}")
    }
}

/// The first `n` characters of a hex cache key, or of a hash of it when it is not hex.
pub(crate) fn key_prefix(key: &str, n: usize) -> String {
    let lower = key.to_ascii_lowercase();
    if lower.len() >= n && lower.bytes().all(|b| b.is_ascii_hexdigit()) {
        lower[..n].to_string()
    } else {
        blake3::hash(key.as_bytes()).to_hex()[..n].to_string()
    }
}

/// Lower-cases and maps everything outside `[a-z0-9]` to single dashes.
pub(crate) fn dns_part(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            out.push(c);
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    trim_dashes(&out).to_string()
}

fn trim_dashes(s: &str) -> &str {
    s.trim_matches('-')
}

fn starts_with_letter(s: &str) -> bool {
    s.bytes().next().is_some_and(|b| b.is_ascii_lowercase())
}

/// Shares `room` characters between two parts, giving the shorter one all it needs first.
fn split_room(a: usize, b: usize, room: usize) -> (usize, usize) {
    if a + b <= room {
        return (a, b);
    }
    let half = room / 2;
    if a <= half {
        (a, room - a)
    } else if b <= half {
        (room - b, b)
    } else {
        (half, room - half)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_names_are_kept_readable() {
        assert_eq!(trainjob_name("gpt", "train", "0123456789abcdef", 1), "gpt-train-01234567");
        assert_eq!(trainjob_name("gpt", "train", "0123456789abcdef", 3), "gpt-train-01234567-a3");
    }

    #[test]
    fn altered_names_carry_a_hash() {
        let a = trainjob_name("gpt_tp2", "train", "0123456789abcdef", 1);
        let b = trainjob_name("gpt.tp2", "train", "0123456789abcdef", 1);
        assert_ne!(a, b);
        assert!(a.starts_with("gpt-tp2-train-"), "{a}");
    }

    /// `gpt` + `tiny-model` and `gpt-tiny` + `model` must not read alike, nor any plain name a
    /// hashed one.
    #[test]
    fn names_whose_dashes_could_be_read_two_ways_differ() {
        let key = "c529ba77ffffffff";
        let a = trainjob_name("gpt", "tiny-model", key, 1);
        let b = trainjob_name("gpt-tiny", "model", key, 1);
        assert_ne!(a, b);
        assert_eq!(a, "gpt-tiny-model-c529ba77");
        let mut seen = std::collections::HashMap::new();
        let parts = ["a", "b", "a-b", "b-a", "a-b-c", "c", "ab", "x1"];
        for p in parts {
            for s in parts {
                for attempt in [1, 2] {
                    let name = trainjob_name(p, s, key, attempt);
                    assert!(is_rfc1035_label(&name), "{name}");
                    if let Some(other) = seen.insert(name.clone(), (p, s, attempt)) {
                        panic!("{name}: {other:?} and {:?}", (p, s, attempt));
                    }
                }
            }
        }
    }

    #[test]
    fn digit_first_pipelines_get_a_letter() {
        let name = trainjob_name("7b", "convert", "ffffffffffff", 1);
        assert!(is_rfc1035_label(&name), "{name}");
    }

    #[test]
    fn names_over_the_limit_say_the_limit_and_which_name() {
        let long = "n".repeat(64);
        let e = check_namespace(&long).unwrap_err();
        assert_eq!(e.to_string(), format!("namespace \"{long}\" is 64 characters long; Kubernetes allows at most 63"));
        assert!(check_namespace(&"n".repeat(63)).is_ok());
        assert!(check_namespace("Team_A").unwrap_err().to_string().contains("'T' is not a lower-case letter"));
        let e = check_service_account(&"s".repeat(254)).unwrap_err();
        assert!(
            e.to_string().starts_with("service account \"sss")
                && e.to_string().ends_with("is 254 characters long; Kubernetes allows at most 253"),
            "{e}"
        );
        assert!(check_service_account("mflow.runner-1").is_ok());
        assert!(check_service_account("mflow..x").is_err());
    }

    #[test]
    fn claims_and_runtimes_are_dns_subdomains() {
        for ok in ["mflow-artifacts", "mflow.torch-2", "a"] {
            assert!(check_claim(ok).is_ok() && check_runtime(ok).is_ok(), "{ok}");
        }
        assert!(check_claim("").unwrap_err().to_string().contains("it is empty"));
        assert!(check_claim("My_PVC").unwrap_err().to_string().contains("'M' is not a lower-case letter"));
        assert!(check_runtime("-torch").unwrap_err().to_string().contains("starts or ends with `-`"));
        assert!(check_runtime(&"r".repeat(254)).unwrap_err().to_string().contains("at most 253"));
    }

    #[test]
    fn label_values_are_valid() {
        assert_eq!(label_value("gpt-tp2"), "gpt-tp2");
        let long = "x".repeat(100);
        assert!(label_value(&long).len() <= MAX_LABEL_VALUE);
        assert_eq!(label_value("a/b"), format!("a-b-{}", &blake3::hash(b"a/b").to_hex()[..8]));
    }
}
