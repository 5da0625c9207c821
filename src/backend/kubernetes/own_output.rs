//! The directory a TrainJob writes its output to, and the move of that output into the
//! engine's staging directory once the TrainJob completed.
//!
//! The engine stages an attempt's output in `<cache>/.staging/<key>.<run>/out` and clears the
//! staging directories of a key when a run starts. A TrainJob outlives the mflow process that
//! submitted it, so it writes to `<cache>/.kube/<trainjob>/out` instead: named after the
//! TrainJob, found again by a restarted mflow, and left alone by the engine.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use super::KubernetesError;
use crate::backend::Job;

pub(super) struct OwnOutput {
    /// `<cache>/.kube/<trainjob>`: the TrainJob's working area (native stages stage next to `out`).
    pub dir: PathBuf,
    /// What becomes the engine's staged output.
    pub out: PathBuf,
    staged: String,
}

impl OwnOutput {
    /// `None` when the engine's output is not a cache staging directory (then the TrainJob
    /// writes to it directly).
    pub fn of(staged: &Path, trainjob: &str) -> Option<OwnOutput> {
        let staging = staged.parent()?.parent()?;
        if staging.file_name()? != ".staging" {
            return None;
        }
        let dir = staging.parent()?.join(".kube").join(trainjob);
        Some(OwnOutput { out: dir.join("out"), dir, staged: staged.to_string_lossy().to_string() })
    }

    /// The job as the TrainJob runs it: the engine's staging output replaced by the TrainJob's
    /// own in arguments, environment, and the JSON config files the arguments name (train,
    /// evaluate and export verification read their output path from those).
    pub fn rewrite(&self, job: &Job) -> Result<Job, KubernetesError> {
        let own = self.out.to_string_lossy().to_string();
        let swap = |s: &str| swap_path(s, &self.staged, &own);
        let mut job = job.clone();
        let attempt_dir = job.log.parent().map(Path::to_path_buf).unwrap_or_default();
        for argv in &mut job.steps {
            for arg in argv.iter_mut() {
                let path = Path::new(arg.as_str());
                if arg.ends_with(".json") && path.starts_with(&attempt_dir) && path.is_file() {
                    rewrite_config(path, &swap)?;
                }
                *arg = swap(arg);
            }
        }
        for value in job.env.values_mut() {
            *value = swap(value);
        }
        Ok(job)
    }

    /// Moves the completed TrainJob's output into the engine's staging directory.
    pub fn deliver(&self, staged: &Path) -> Result<(), String> {
        if !self.out.is_dir() {
            return Err(format!("the TrainJob completed, but its output {} is missing from the artifact volume", self.out.display()));
        }
        // The engine's `out` is empty (or absent, for native stages); it only stands in the way.
        let _ = std::fs::remove_dir(staged);
        std::fs::rename(&self.out, staged).map_err(|e| format!("cannot move {} to {}: {e}", self.out.display(), staged.display()))?;
        let _ = std::fs::remove_dir_all(&self.dir);
        Ok(())
    }

    /// Removes what a failed or superseded TrainJob left.
    pub fn clear(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn rewrite_config(path: &Path, swap: &dyn Fn(&str) -> String) -> Result<(), KubernetesError> {
    let volume = |e: String| KubernetesError::Volume { path: path.display().to_string(), message: e };
    // Written by the stage: read as any file someone else wrote.
    let text = crate::untrusted::read_text(path, crate::untrusted::SMALL_JSON).map_err(|e| volume(e.to_string()))?;
    let mut config: Json = serde_json::from_str(&text).map_err(|e| volume(e.to_string()))?;
    swap_strings(&mut config, swap);
    std::fs::write(path, serde_json::to_vec_pretty(&config).unwrap_or_default()).map_err(|e| volume(e.to_string()))
}

/// `s` with each mention of the path `from`, or of a path under it, replaced by `to`. A
/// sibling that only starts with the same characters (`<from>.status.json`) stays.
fn swap_path(s: &str, from: &str, to: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find(from) {
        let after = &rest[i + from.len()..];
        let whole = after.chars().next().is_none_or(|c| c == '/' || !(c.is_alphanumeric() || matches!(c, '.' | '-' | '_')));
        out.push_str(&rest[..i]);
        out.push_str(if whole { to } else { from });
        rest = after;
    }
    out.push_str(rest);
    out
}

fn swap_strings(v: &mut Json, swap: &dyn Fn(&str) -> String) {
    match v {
        Json::String(s) => *s = swap(s),
        Json::Array(items) => items.iter_mut().for_each(|i| swap_strings(i, swap)),
        Json::Object(map) => map.values_mut().for_each(|i| swap_strings(i, swap)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn only_cache_staging_directories_are_redirected() {
        let own = OwnOutput::of(Path::new("/mflow/p/cache/.staging/abc.run1/out"), "p-s-abc").unwrap();
        assert_eq!(own.out, Path::new("/mflow/p/cache/.kube/p-s-abc/out"));
        assert!(OwnOutput::of(Path::new("/mflow/p/elsewhere/out"), "p-s-abc").is_none());
    }

    #[test]
    fn only_whole_path_mentions_are_swapped() {
        let swap = |s: &str| swap_path(s, "/c/.staging/k.r", "/c/.kube/t/out");
        assert_eq!(swap("/c/.staging/k.r"), "/c/.kube/t/out");
        assert_eq!(swap("--out=/c/.staging/k.r/model"), "--out=/c/.kube/t/out/model");
        assert_eq!(swap("a /c/.staging/k.r b"), "a /c/.kube/t/out b");
        assert_eq!(swap("/c/.staging/k.r.status.json"), "/c/.staging/k.r.status.json");
        assert_eq!(swap("/c/.staging/k.r2"), "/c/.staging/k.r2");
    }

    #[test]
    fn paths_are_rewritten_in_arguments_environment_and_configs() {
        let root = std::env::temp_dir().join(format!("mflow-own-output-{}", fastrand::u64(..)));
        let staged = root.join("cache/.staging/k.r/out");
        let attempt = root.join("runs/r/stages/train");
        std::fs::create_dir_all(&attempt).unwrap();
        let config = attempt.join("train-config-1.json");
        std::fs::write(&config, serde_json::json!({"output": staged, "nested": [staged.join("x")]}).to_string()).unwrap();
        let job = Job {
            stage: "train".into(),
            key: "k".into(),
            attempt: 1,
            steps: vec![vec!["python".into(), config.display().to_string(), format!("--out={}", staged.display())]],
            env: BTreeMap::from([("MFLOW_OUTPUT".to_string(), staged.display().to_string())]),
            cwd: root.clone(),
            timeout: None,
            log: attempt.join("attempt-1.log"),
            status_file: attempt.join("attempt-1.status.json"),
        };
        let own = OwnOutput::of(&staged, "p-train-k").unwrap();
        let pod = own.rewrite(&job).unwrap();
        let want = own.out.display().to_string();
        assert_eq!(pod.env["MFLOW_OUTPUT"], want);
        assert_eq!(pod.steps[0][2], format!("--out={want}"));
        let written: Json = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
        assert_eq!(written["output"], want.as_str());
        assert_eq!(written["nested"][0], own.out.join("x").display().to_string().as_str());

        std::fs::create_dir_all(&own.out).unwrap();
        std::fs::write(own.out.join("result"), "1").unwrap();
        std::fs::create_dir_all(&staged).unwrap();
        own.deliver(&staged).unwrap();
        assert_eq!(std::fs::read_to_string(staged.join("result")).unwrap(), "1");
        assert!(!own.dir.exists());
        assert!(own.deliver(&staged).is_err(), "a missing output must not count as delivered");
        let _ = std::fs::remove_dir_all(&root);
    }
}
