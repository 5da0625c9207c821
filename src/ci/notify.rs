//! `[notify] webhook = "URL"`: POST a JSON summary of the run when it ends. A notification is
//! best effort: failures are retried with exponential backoff, then reported as a warning; they
//! never change the run's exit code. Webhook URLs are secrets (tokens in paths and queries), so
//! only a redacted form is ever printed.

use std::time::Duration;

use serde_json::{json, Map, Value as Json};

use super::run_data::{status_word, RunData};
use crate::record::{RunStatus, StageStatus};

/// Wait before the first retry; doubled each time, capped at MAX_BACKOFF.
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct Config {
    pub webhook: String,
    pub on_success: bool,
    pub on_failure: bool,
    pub timeout: Duration,
    pub retries: u32,
}

impl Config {
    /// From the spec's validated `[notify]` table. `webhook = "env:NAME"` reads the URL from the
    /// environment variable NAME, so that it need not be written in the spec.
    pub fn from_spec(t: &Map<String, Json>) -> Result<Config, String> {
        let raw = t.get("webhook").and_then(Json::as_str).unwrap_or_default();
        let webhook = match raw.strip_prefix("env:") {
            Some(var) => {
                std::env::var(var).map_err(|_| format!("[notify] webhook: environment variable {var} is not set"))?
            }
            None => raw.to_string(),
        };
        let on: Vec<String> = match t.get("on").and_then(Json::as_array) {
            Some(a) => a.iter().filter_map(Json::as_str).map(str::to_string).collect(),
            None => vec!["success".into(), "failure".into()],
        };
        let timeout = match t.get("timeout") {
            Some(Json::String(s)) => humantime::parse_duration(s).map_err(|e| format!("[notify] timeout: {e}"))?,
            Some(v) => Duration::from_secs_f64(v.as_f64().unwrap_or(10.0)),
            None => Duration::from_secs(10),
        };
        let retries = t.get("retries").and_then(Json::as_u64).unwrap_or(3).min(20) as u32;
        Ok(Config {
            webhook,
            on_success: on.iter().any(|o| o == "success"),
            on_failure: on.iter().any(|o| o == "failure"),
            timeout,
            retries,
        })
    }

    pub fn wants(&self, status: RunStatus) -> bool {
        if status == RunStatus::Succeeded {
            self.on_success
        } else {
            self.on_failure
        }
    }
}

/// The JSON body: the run, each stage, and a one-line `text` (chat webhooks show it).
pub fn payload(run: &RunData) -> Json {
    let r = &run.record;
    let stages: Vec<Json> = run
        .stages()
        .map(|(name, s)| {
            json!({
                "name": name, "kind": s.kind, "status": status_word(s.status), "cached": s.status == StageStatus::Cached,
                "duration_s": super::run_data::stage_duration(s), "attempts": s.attempts.len(), "message": s.failure(), "class": s.class, "metrics": s.metrics,
            })
        })
        .collect();
    let failed: Vec<&String> = run.stages().filter(|(_, s)| s.status == StageStatus::Failed).map(|(n, _)| n).collect();
    let status = format!("{:?}", r.status).to_lowercase();
    let text = if failed.is_empty() {
        format!("mflow: pipeline {} {status} (run {})", r.pipeline, r.id)
    } else {
        format!(
            "mflow: pipeline {} {status} (run {}); failed: {}",
            r.pipeline,
            r.id,
            failed.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
        )
    };
    json!({
        "text": text, "pipeline": r.pipeline, "run": r.id, "status": status, "exit_code": r.exit_code,
        "started": r.started, "finished": r.finished, "mflow_version": r.mflow_version, "stages": stages,
    })
}

/// Sends `body`, retrying transport errors and non-2xx answers. Err carries a printable reason
/// that contains no part of the URL.
pub async fn send(cfg: &Config, body: &Json) -> Result<u32, String> {
    let client = reqwest::Client::builder()
        .timeout(cfg.timeout)
        .user_agent(concat!("mflow/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| e.without_url().to_string())?;
    let mut wait = FIRST_BACKOFF;
    let mut last = String::new();
    for attempt in 1..=cfg.retries + 1 {
        match client.post(&cfg.webhook).json(body).send().await {
            Ok(resp) if resp.status().is_success() => return Ok(attempt),
            Ok(resp) => last = format!("HTTP {}", resp.status()),
            Err(e) => last = e.without_url().to_string(),
        }
        if attempt <= cfg.retries {
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(MAX_BACKOFF);
        }
    }
    Err(format!("{last} after {} attempt(s)", cfg.retries + 1))
}

/// Notifies about a finished run if the spec asks for it; warns on failure, never fails.
pub async fn after_run(table: Option<&Map<String, Json>>, run: &RunData) {
    let Some(t) = table else { return };
    let cfg = match Config::from_spec(t) {
        Ok(c) => c,
        Err(e) => {
            crate::errln!("mflow: warning: notification not sent: {e}");
            return;
        }
    };
    if !cfg.wants(run.record.status) {
        return;
    }
    if let Err(e) = send(&cfg, &payload(run)).await {
        crate::errln!(
            "mflow: warning: notification to {} failed: {e}; the run's result is unaffected",
            redact(&cfg.webhook)
        );
    }
}

/// scheme://host[:port]/first-segment/… : no user info, no query, no later path segments
/// (chat webhooks carry their token in the path).
pub fn redact(url: &str) -> String {
    let Ok(u) = reqwest::Url::parse(url) else { return "<invalid webhook URL>".into() };
    let mut out = format!("{}://{}", u.scheme(), u.host_str().unwrap_or(""));
    if let Some(p) = u.port() {
        out.push_str(&format!(":{p}"));
    }
    let mut segs = u.path_segments().into_iter().flatten().filter(|s| !s.is_empty());
    if let Some(first) = segs.next() {
        out.push('/');
        out.push_str(first);
    }
    if segs.next().is_some() || u.query().is_some() {
        out.push_str("/…");
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn redaction_keeps_no_secret() {
        let r = super::redact("https://user:pa55@hooks.example.com/services/T0/B0/s3cret?token=s3cret#x");
        assert_eq!(r, "https://hooks.example.com/services/…");
        assert!(!r.contains("s3cret") && !r.contains("pa55"));
        assert_eq!(super::redact("http://127.0.0.1:9/hook"), "http://127.0.0.1:9/hook");
    }
}
