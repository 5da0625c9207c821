//! The kubelet's variable expansion in a container's `command`, `args` and `env[].value`:
//! `$(NAME)` becomes the value of variable NAME where it is defined and `$$` becomes `$`.
//! mflow's values are literal (a stage's argv and environment mean what they mean locally, and
//! its cache key is the same), so every `$` of them is written as `$$` ([`escape`]); none of
//! the values mflow writes relies on an expansion.

/// `value` as the kubelet gives it back unchanged: every `$` doubled.
pub fn escape(value: &str) -> String {
    value.replace('$', "$$")
}

/// The value [`escape`] was given: a value read back from an object mflow wrote.
pub(crate) fn unescape(value: &str) -> String {
    value.replace("$$", "$")
}

/// What the kubelet makes of `input` (Kubernetes' `expansion.Expand`): `$$` is `$`, `$(NAME)`
/// the value `lookup` gives for NAME, and kept as written where NAME is undefined; any other
/// `$` stays. For stand-ins of a kubelet (the fake controller) and tests.
pub fn expand(input: &str, lookup: &dyn Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some((name, tail)) = after.strip_prefix('(').and_then(|a| a.split_once(')')) {
            match lookup(name) {
                Some(v) => out.push_str(&v),
                None => out.push_str(&format!("$({name})")),
            }
            rest = tail;
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defined(name: &str) -> Option<String> {
        (name == "X").then(|| "expanded".to_string())
    }

    #[test]
    fn the_kubelet_expands_references_and_double_dollars() {
        assert_eq!(expand("a $(X) $(Y) $$ $$(X) $ $0 $(", &defined), "a expanded $(Y) $ $(X) $ $0 $(");
        assert_eq!(expand("$", &defined), "$");
    }

    #[test]
    fn an_escaped_value_reaches_the_container_as_written() {
        for v in ["echo $$", "echo '$(X)'", "$", "$(X", "$$$(X)$", "cd \"$0\" && exec \"$@\"", "plain", ""] {
            assert_eq!(expand(&escape(v), &defined), v);
            assert_eq!(unescape(&escape(v)), v);
        }
    }
}
