//! Loading the client configuration the way kubectl finds it (the options' kubeconfig,
//! `KUBECONFIG`, `~/.kube/config`, else the pod's service account), keeping the names of the
//! kubeconfig, context, user and server so that every error can say which of them is wrong.

use std::path::{Path, PathBuf};

use kube::config::{KubeConfigOptions, Kubeconfig, KubeconfigError};
use kube::Config;

use crate::error::Target;
use crate::{KubeError, KubeOptions};

/// The configuration of `opts`, and what it names.
pub(crate) async fn load(opts: &KubeOptions) -> Result<(Config, Target), KubeError> {
    let Some(paths) = kubeconfig_paths(opts) else {
        if let Some(context) = &opts.context {
            return Err(KubeError::UnknownContext {
                context: context.clone(),
                available: Vec::new(),
                kubeconfig: "(no kubeconfig: KUBECONFIG is unset and ~/.kube/config does not exist)".into(),
            });
        }
        let config = Config::incluster().map_err(|e| KubeError::Config {
            message: format!(
                "no kubeconfig (KUBECONFIG is unset and ~/.kube/config does not exist), and not in a pod: {e}"
            ),
        })?;
        let target = Target { url: config.cluster_url.to_string(), in_cluster: true, ..Target::default() };
        return Ok((config, target));
    };
    let shown = paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(":");
    let mut merged: Option<Kubeconfig> = None;
    for path in &paths {
        let one = Kubeconfig::read_from(path).map_err(|e| kubeconfig_error(path, &e))?;
        merged = Some(match merged {
            None => one,
            Some(m) => m.merge(one).map_err(|e| kubeconfig_error(path, &e))?,
        });
    }
    let kubeconfig = merged.unwrap_or_default();
    let available: Vec<String> = kubeconfig.contexts.iter().map(|c| c.name.clone()).collect();
    let Some(context) = opts.context.clone().or_else(|| kubeconfig.current_context.clone().filter(|c| !c.is_empty()))
    else {
        return Err(KubeError::UnknownContext { context: String::new(), available, kubeconfig: shown });
    };
    let Some(named) = kubeconfig.contexts.iter().find(|c| c.name == context) else {
        return Err(KubeError::UnknownContext { context, available, kubeconfig: shown });
    };
    let (user, cluster) = match &named.context {
        Some(c) => (c.user.clone(), Some(c.cluster.clone())),
        None => (None, None),
    };
    let kc_opts = KubeConfigOptions { context: Some(context.clone()), ..Default::default() };
    let config = Config::from_custom_kubeconfig(kubeconfig, &kc_opts).await.map_err(|e| KubeError::Kubeconfig {
        path: shown.clone(),
        message: format!("context {context:?}: {}", crate::error::chain(&e)),
    })?;
    let target = Target {
        url: config.cluster_url.to_string(),
        context: Some(context),
        user,
        cluster,
        kubeconfig: Some(shown),
        in_cluster: false,
    };
    Ok((config, target))
}

/// The kubeconfig files to read, in kubectl's order; `None` for the in-cluster configuration.
fn kubeconfig_paths(opts: &KubeOptions) -> Option<Vec<PathBuf>> {
    if let Some(path) = &opts.kubeconfig {
        return Some(vec![path.clone()]);
    }
    if let Some(list) = std::env::var_os("KUBECONFIG").filter(|v| !v.is_empty()) {
        let paths: Vec<PathBuf> = std::env::split_paths(&list).filter(|p| !p.as_os_str().is_empty()).collect();
        if !paths.is_empty() {
            return Some(paths);
        }
    }
    let home = std::env::var_os("HOME").map(PathBuf::from)?;
    let default = home.join(".kube").join("config");
    default.exists().then_some(vec![default])
}

/// A kubeconfig that cannot be read, in words that never quote its contents (a broken file
/// may hold a token next to the mistake).
fn kubeconfig_error(path: &Path, err: &KubeconfigError) -> KubeError {
    let message = match err {
        KubeconfigError::ReadConfig(io, _) if io.kind() == std::io::ErrorKind::NotFound => {
            "the file does not exist".to_string()
        }
        KubeconfigError::ReadConfig(io, _) => io.to_string(),
        KubeconfigError::Parse(e) => format!("not a valid kubeconfig (YAML){}", location(&e.to_string())),
        other => other.to_string(),
    };
    KubeError::Kubeconfig { path: path.display().to_string(), message }
}

/// ` at line L, column C` when the parser's message gives one.
fn location(message: &str) -> String {
    let lower = message.to_lowercase();
    let number_after = |word: &str| -> Option<u64> {
        let at = lower.find(word)? + word.len();
        lower[at..].trim_start_matches([' ', ':']).split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
    };
    match (number_after("line"), number_after("column")) {
        (Some(l), Some(c)) => format!(" at line {l}, column {c}"),
        (Some(l), None) => format!(" at line {l}"),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parse_error_is_reduced_to_its_place() {
        assert_eq!(
            location("invalid type: string \"abc\", expected a sequence at line 3 column 9"),
            " at line 3, column 9"
        );
        assert_eq!(location("mapping values are not allowed (line: 4, column: 12)"), " at line 4, column 12");
        assert_eq!(location("something odd"), "");
    }
}
