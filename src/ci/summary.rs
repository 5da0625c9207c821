//! The Markdown summary of a run, appended to `$GITHUB_STEP_SUMMARY` when GitHub Actions sets it.

use serde_json::Value as Json;

use super::run_data::{human_duration, stage_duration, status_word, RunData};
use crate::record::{RunStatus, StageStatus};

/// Metrics shown per stage; the rest are in the HTML report.
const MAX_METRICS: usize = 6;

pub fn render(run: &RunData) -> String {
    let r = &run.record;
    let status = match r.status {
        RunStatus::Succeeded => "succeeded",
        RunStatus::Failed => "failed",
        RunStatus::Cancelled => "cancelled",
        RunStatus::Interrupted => "interrupted",
        RunStatus::Running => "running",
    };
    let mut out = format!("### mflow run `{}`: {status}\n\n", code(&r.pipeline));
    out.push_str(&format!(
        "Run `{}`, exit code {}.\n\n",
        code(&r.id),
        r.exit_code.map(|c| c.to_string()).unwrap_or("-".into())
    ));
    out.push_str("| Stage | Status | Cached | Duration | Key metrics |\n|---|---|---|---|---|\n");
    for (name, s) in run.stages() {
        let icon = match s.status {
            StageStatus::Succeeded | StageStatus::Cached => "✅",
            StageStatus::Failed => "❌",
            _ => "⏭️",
        };
        let mut status = format!("{icon} {}", status_word(s.status));
        if s.status == StageStatus::Failed {
            if let Some(m) = s.failure() {
                status.push_str(&format!(": {}", first_line(&m)));
            }
        }
        let cached = if s.status == StageStatus::Cached { "yes" } else { "no" };
        let metrics = s.metrics.as_ref().map(key_metrics).unwrap_or_default();
        out.push_str(&format!(
            "| {} | {} | {cached} | {} | {} |\n",
            cell(name),
            cell(&status),
            human_duration(stage_duration(s)),
            cell(&metrics)
        ));
    }
    out.push('\n');
    out
}

/// Appends the summary when `GITHUB_STEP_SUMMARY` names a file; does nothing otherwise.
/// The file is the user's (or the CI runner's): appended to as any user-named output is written.
/// Top-level numbers first, then numbers one level down (`valid.loss`), at most MAX_METRICS.
fn key_metrics(m: &Json) -> String {
    let Some(o) = m.as_object() else { return String::new() };
    let mut items: Vec<String> = o.iter().filter_map(|(k, v)| v.as_f64().map(|x| format!("{k}={}", num(x)))).collect();
    for (k, v) in o {
        if let Some(inner) = v.as_object() {
            items.extend(inner.iter().filter_map(|(k2, v)| v.as_f64().map(|x| format!("{k}.{k2}={}", num(x)))));
        }
    }
    items.truncate(MAX_METRICS);
    items.join(", ")
}

pub fn num(x: f64) -> String {
    if x != 0.0 && (x.abs() >= 1e5 || x.abs() < 1e-3) {
        format!("{x:.3e}")
    } else if x.fract() == 0.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.4}").trim_end_matches('0').to_string()
    }
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("")
}

/// Table cells cannot hold pipes or newlines. GitHub renders inline HTML, so stage messages and
/// metric names are escaped; control characters (colours, NUL) are dropped, as in JUnit.
fn cell(s: &str) -> String {
    // The HTML report's escaping: a step summary is Markdown with inline HTML.
    super::report::html::esc(&super::junit::clean(s)).replace('|', "\\|").replace(['\n', '\r'], " ")
}

/// The text of a code span: shown as it is (an entity would show as `&lt;`), so only what could
/// end the span or the line goes.
fn code(s: &str) -> String {
    super::junit::clean(s).replace('`', "'").replace(['\n', '\r'], " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_escape_html_and_drop_control_characters() {
        let nasty = "x</td><script>alert(1)</script> <img src=x onerror=y> <!-- a & b | c\u{1b}[31m\0d\ne";
        assert_eq!(
            cell(nasty),
            "x&lt;/td&gt;&lt;script&gt;alert(1)&lt;/script&gt; &lt;img src=x onerror=y&gt; &lt;!-- a &amp; b \\| cd e"
        );
        assert_eq!(code("p`<b>\u{0}\n"), "p'<b> ");
    }
}
