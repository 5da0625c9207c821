//! Kubernetes quantities (`resources.memory`), checked before anything is rendered.

/// Why `q` is not a memory quantity a pod can request, or `None` when it is one: the grammar of
/// Kubernetes' `resource.Quantity` (sign, digits with an optional fraction, then a binary
/// suffix `Ki`..`Ei`, a decimal one `m`, `k`, `M`..`E`, or an exponent `e`/`E` with an
/// integer), and not below zero, which the API server's schema lets through but no pod takes.
pub fn memory_problem(q: &str) -> Option<String> {
    let (negative, body) = match q.as_bytes().first() {
        Some(b'-') => (true, &q[1..]),
        Some(b'+') => (false, &q[1..]),
        _ => (false, q),
    };
    let number_end = body.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(body.len());
    let (number, suffix) = body.split_at(number_end);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if q.is_empty() {
        return Some("it is empty".into());
    }
    if whole.is_empty() && fraction.is_empty() {
        return Some("it does not start with a number".into());
    }
    if !digits(fraction) {
        return Some(format!("`{number}` is not a number"));
    }
    if !suffix_ok(suffix) {
        // A few characters say which unit was meant; the spec's excerpt shows the rest.
        let shown: String = suffix.chars().take(12).collect();
        let more = if shown.len() < suffix.len() { "…" } else { "" };
        return Some(format!("`{}{more}` is not a unit of a Kubernetes quantity", shown.escape_debug()));
    }
    if negative && number.bytes().any(|b| b.is_ascii_digit() && b != b'0') {
        return Some("it is negative".into());
    }
    None
}

fn suffix_ok(suffix: &str) -> bool {
    const UNITS: &[&str] = &["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "m", "k", "M", "G", "T", "P", "E"];
    if UNITS.contains(&suffix) {
        return true;
    }
    let Some(exponent) = suffix.strip_prefix(['e', 'E']) else { return false };
    let exponent = exponent.strip_prefix(['+', '-']).unwrap_or(exponent);
    !exponent.is_empty() && exponent.bytes().all(|b| b.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_quantities_follow_the_kubernetes_grammar() {
        for ok in
            ["16Gi", "512Mi", "1.5Gi", ".5Gi", "5.Gi", "1e9", "1E3", "1e+3", "128974848", "129M", "0", "+1Gi", "-0"]
        {
            assert_eq!(memory_problem(ok), None, "{ok}");
        }
        for (bad, why) in [
            ("16GB", "`GB` is not a unit"),
            ("16gi", "`gi` is not a unit"),
            ("lots", "does not start with a number"),
            ("", "it is empty"),
            (" 1Gi", "does not start with a number"),
            ("1Gi ", "`Gi ` is not a unit"),
            ("-1Gi", "it is negative"),
            ("1.2.3", "`1.2.3` is not a number"),
            ("1e", "`e` is not a unit"),
            (".", "does not start with a number"),
            ("Gi", "does not start with a number"),
        ] {
            let problem = memory_problem(bad).unwrap_or_else(|| panic!("{bad:?} accepted"));
            assert!(problem.contains(why), "{bad:?}: {problem}");
        }
    }
}
