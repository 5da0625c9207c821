//! Values of a checked table, read into the spec's types: strings, lists, durations, retry
//! policies and resources.

use std::time::Duration;

use serde_json::{Map, Value as Json};

use super::error::{to_span, SpecError, Src};
use super::tree::{Node, Val};
use super::{Resources, RetryPolicy};
use mflow_contract::FailureClass;

pub(super) fn str_of(m: &Map<String, Json>, k: &str) -> Option<String> {
    m.get(k).and_then(Json::as_str).map(str::to_string)
}

pub(super) fn strs(v: Option<&Json>) -> Vec<String> {
    v.and_then(Json::as_array)
        .map(|a| a.iter().filter_map(|x| x.as_str().map(str::to_string)).collect())
        .unwrap_or_default()
}

pub(super) fn duration(v: &Json) -> Option<Duration> {
    humantime::parse_duration(v.as_str()?).ok()
}

pub(super) fn retry_policy(v: &Json) -> RetryPolicy {
    let d = RetryPolicy::default();
    RetryPolicy {
        max: v.get("max").and_then(Json::as_u64).map(|n| n as u32).unwrap_or(d.max),
        backoff: v.get("backoff").and_then(duration).unwrap_or(d.backoff),
        max_backoff: v.get("max_backoff").and_then(duration).unwrap_or(d.max_backoff),
        on: v
            .get("on")
            .and_then(Json::as_array)
            .map(|a| a.iter().filter_map(|c| FailureClass::parse(c.as_str()?)).collect())
            .unwrap_or(d.on),
    }
}

/// Most cores and GPUs one stage may ask for: beyond any machine, and beyond what the
/// scheduler's counts are meant for.
const MAX_CPUS: f64 = 4096.0;
const MAX_GPUS: i64 = 1024;
/// One millicore, the smallest CPU request Kubernetes can express.
const MIN_CPUS: f64 = 0.001;
/// The CronJob controller looks for missed schedules every 10 seconds: a shorter deadline may
/// pass before it looks, and the run never starts.
const MIN_STARTING_DEADLINE: Duration = Duration::from_secs(10);

/// `[schedule] starting_deadline` shorter than the controller's period.
pub(super) fn check_schedule(src: &Src, node: &Node, errors: &mut Vec<SpecError>) {
    let Some(at) = node.get("starting_deadline") else { return };
    let Val::Str(s) = &at.value else { return };
    // Not a duration at all is reported by the field's type.
    let Ok(d) = humantime::parse_duration(s) else { return };
    if d >= MIN_STARTING_DEADLINE {
        return;
    }
    errors.push(SpecError::InvalidValue {
        src: src.clone(),
        span: to_span(at.span()),
        key: "[schedule].starting_deadline".into(),
        reason: format!(
            "{} is shorter than the 10 seconds between the CronJob controller's checks",
            humantime::format_duration(d)
        ),
        help: "give at least \"10s\", or leave it out for the default of \"1h\"".into(),
    });
}

/// `resources` values that parse but mean nothing: no cores, negative or absurd counts.
pub(super) fn check_resources(src: &Src, node: &Node, table: &str, errors: &mut Vec<SpecError>) {
    let bad = |errors: &mut Vec<SpecError>, at: &Node, key: &str, reason: String, help: &str| {
        errors.push(SpecError::InvalidValue {
            src: src.clone(),
            span: to_span(at.span()),
            key: format!("{table}.resources.{key}"),
            reason,
            help: help.into(),
        })
    };
    if let Some(at) = node.get("cpus") {
        let cpus = match at.value {
            Val::Int(i) => Some(i as f64),
            Val::Float(f) => Some(f),
            _ => None,
        };
        if let Some(c) = cpus.filter(|c| c.is_finite() && (*c <= 0.0 || *c > MAX_CPUS)) {
            let c = if c.abs() >= 1e6 { format!("{c:e}") } else { c.to_string() };
            bad(errors, at, "cpus", format!("{c} cores"), "ask for more than 0 and at most 4096 cores, e.g. 0.5 or 8");
        } else if let Some(c) = cpus.filter(|c| *c > 0.0 && *c < MIN_CPUS) {
            // Kubernetes counts CPU in millicores: less would be requested as `0m`.
            let reason = format!("{c} cores is less than a millicore");
            bad(errors, at, "cpus", reason, "ask for at least 0.001 cores (1m on Kubernetes), e.g. 0.1");
        }
    }
    if let Some(at) = node.get("gpus") {
        if let Val::Int(g) = at.value {
            if !(0..=MAX_GPUS).contains(&g) {
                bad(errors, at, "gpus", format!("{g} GPUs"), "ask for 0 to 1024 GPUs per node");
            }
        }
    }
}

pub(super) fn resources_of(v: &Json) -> Resources {
    Resources {
        gpus: v.get("gpus").and_then(Json::as_u64).unwrap_or(0) as u32,
        cpus: v.get("cpus").and_then(Json::as_f64).unwrap_or(1.0),
        cpus_given: v.get("cpus").is_some(),
        memory: v.get("memory").and_then(Json::as_str).map(str::to_string),
    }
}
