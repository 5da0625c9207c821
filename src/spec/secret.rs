//! Credentials in a spec. A spec is a record: the lockfile, the run's records, plans and reports
//! keep its values, so a credential must reach a stage through mflow's own environment instead.

/// Whether an environment variable's name says it holds a credential (`HF_TOKEN`,
/// `WANDB_API_KEY`, `AWS_SECRET_ACCESS_KEY`, `PGPASSWORD`), judged by how its words end, so
/// that `TOKENIZERS_PARALLELISM` or `MAX_TOKENS` are not.
pub fn credential_name(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    let words: Vec<&str> = upper.split('_').filter(|w| !w.is_empty()).collect();
    words.iter().enumerate().any(|(i, w)| {
        ["TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "APIKEY"].iter().any(|end| w.ends_with(end))
            || matches!(*w, "CREDENTIAL" | "CREDENTIALS")
            || (*w == "KEY" && i > 0 && matches!(words[i - 1], "API" | "ACCESS" | "PRIVATE" | "SECRET" | "AUTH"))
    })
}

/// Whether a `--set` key names a value that must not be echoed or recorded.
pub fn credential_key(key: &str) -> bool {
    let parts: Vec<&str> = key.trim().split('.').collect();
    match parts.as_slice() {
        [.., "env", name] => credential_name(name),
        [.., "webhook"] => true,
        _ => false,
    }
}

/// `KEY=VALUE` as it may be shown: the value of a credential key left out.
pub fn shown_override(arg: &str) -> String {
    match arg.split_once('=') {
        Some((key, _)) if credential_key(key) => format!("{key}=<redacted>"),
        _ => arg.to_string(),
    }
}

/// The spec's text with the value of every credential key masked (`*` for each byte, line breaks
/// kept, so that spans and line numbers stay where they were), or None when it holds none. A
/// diagnostic quotes lines around its label, so a neighbour's credential would be shown; this is
/// lexical, not parsed, because a spec that does not parse is quoted too.
pub fn masked(spec: &str) -> Option<String> {
    let b = spec.as_bytes();
    let mut spans = Vec::new();
    let mut i = 0;
    while let Some(eq) = b[i..].iter().position(|&c| c == b'=').map(|p| i + p) {
        i = eq + 1;
        let key = key_before(&spec[..eq]);
        if b.get(eq + 1) == Some(&b'=') || !(credential_name(key) || key == "webhook") {
            continue;
        }
        let end = value_end(b, eq + 1);
        spans.push((eq + 1, end));
        i = end.max(eq + 1);
    }
    if spans.is_empty() {
        return None;
    }
    let mut out = b.to_vec();
    for (from, to) in spans {
        out[from..to].iter_mut().filter(|c| !matches!(c, b'\n' | b'\r' | b' ' | b'\t')).for_each(|c| *c = b'*');
    }
    // only whole characters were replaced, by ASCII
    Some(String::from_utf8(out).expect("masked text is UTF-8"))
}

/// The dotted key that ends just before an `=`: its last part, unquoted (`env."HF_TOKEN"` gives
/// `HF_TOKEN`, `notify.webhook` gives `webhook`).
fn key_before(text: &str) -> &str {
    let text = text.trim_end_matches([' ', '\t']);
    let b = text.as_bytes();
    match b.last() {
        Some(&q @ (b'"' | b'\'')) => {
            let inner = &text[..text.len() - 1];
            inner.rfind(q as char).map_or("", |open| &inner[open + 1..])
        }
        _ => {
            let start = b.iter().rposition(|c| !(c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-')));
            &text[start.map_or(0, |p| p + 1)..]
        }
    }
}

/// Where the value that starts at `from` (after an `=`) ends: a string through its closing quote
/// (or the end of the line; of the text for a multi-line one), else a bare value at `,`, `}`,
/// `]`, `#` or the end of the line.
fn value_end(b: &[u8], from: usize) -> usize {
    let mut i = from;
    while matches!(b.get(i), Some(b' ' | b'\t')) {
        i += 1;
    }
    let find =
        |from: usize, pat: &[u8]| b[from..].windows(pat.len()).position(|w| w == pat).map(|p| from + p + pat.len());
    let line_end = |from: usize| b[from..].iter().position(|&c| c == b'\n').map_or(b.len(), |p| from + p);
    match &b[i..] {
        [q @ (b'"' | b'\''), r, s, ..] if r == q && s == q => find(i + 3, &[*q; 3]).unwrap_or(b.len()),
        [b'"', ..] => {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' && b[j] != b'\n' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            (j + 1).min(line_end(i))
        }
        [b'\'', ..] => find(i + 1, b"'").unwrap_or(b.len()).min(line_end(i)),
        _ => b[i..].iter().position(|c| matches!(c, b',' | b'}' | b']' | b'#' | b'\n')).map_or(b.len(), |p| i + p),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credential_values_are_masked_in_place() {
        let spec = "[stages.a.env]\nHF_TOKEN = \"hf_secret\\\"x\" # note\nMODE = \"fast\"\n\
                    [stages.b]\nenv = { 'WANDB_API_KEY' = 'k1', X = 1 }\nrun = [\"HF_TOKEN==x\"]\n\
                    [notify]\nwebhook = \"\"\"https://u:p@h/\nx\"\"\"\nc.env.PGPASSWORD=bare, y = 2\n";
        let shown = masked(spec).unwrap();
        assert_eq!(shown.len(), spec.len());
        assert_eq!(shown.lines().count(), spec.lines().count());
        for secret in ["hf_secret", "k1", "u:p@h", "bare"] {
            assert!(spec.contains(secret) && !shown.contains(secret), "{secret}: {shown}");
        }
        for kept in ["# note", "MODE = \"fast\"", "X = 1", "run = [\"HF_TOKEN==x\"]", "y = 2"] {
            assert!(shown.contains(kept), "{kept}: {shown}");
        }
        assert_eq!(masked("a = 1\nTOKENIZERS_PARALLELISM = \"false\"\n"), None);
        // unterminated strings end at their line; nothing panics on odd text
        let odd = masked("HF_TOKEN = \"abc\nb = 1\nHF_TOKEN='x\nHF_TOKEN = \"\"\"é").unwrap();
        assert!(odd.contains("b = 1") && !odd.contains("abc") && !odd.contains('é'), "{odd}");
        for text in ["=", "==", "HF_TOKEN=", "'=", "\"HF_TOKEN\"=\"", "é=é"] {
            let _ = masked(text);
        }
    }

    #[test]
    fn credential_names_by_word() {
        for name in [
            "HF_TOKEN",
            "hf_token",
            "GITHUB_TOKEN",
            "WANDB_API_KEY",
            "AWS_SECRET_ACCESS_KEY",
            "DB_PASSWORD",
            "MY_SECRET",
            "PGPASSWD",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "OPENAI_APIKEY",
            "SSH_PRIVATE_KEY",
        ] {
            assert!(credential_name(name), "{name}");
        }
        for name in [
            "TOKENIZERS_PARALLELISM",
            "MAX_TOKENS",
            "MFLOW_MEMORY_BUDGET",
            "KEY",
            "SORT_KEY",
            "CUDA_VISIBLE_DEVICES",
            "MODE",
            "PYTHONHASHSEED",
        ] {
            assert!(!credential_name(name), "{name}");
        }
    }

    #[test]
    fn overrides_of_credentials_are_shown_without_their_value() {
        assert_eq!(shown_override("stages.c.env.HF_TOKEN=hf_abc"), "stages.c.env.HF_TOKEN=<redacted>");
        assert_eq!(shown_override("notify.webhook=http://u:p@h/x"), "notify.webhook=<redacted>");
        assert_eq!(shown_override("stages.c.tp=2"), "stages.c.tp=2");
        assert_eq!(
            shown_override("stages.c.env.TOKENIZERS_PARALLELISM=false"),
            "stages.c.env.TOKENIZERS_PARALLELISM=false"
        );
    }
}
