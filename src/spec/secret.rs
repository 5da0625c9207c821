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

#[cfg(test)]
mod tests {
    use super::*;

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
