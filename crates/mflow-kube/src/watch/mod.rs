//! Following a submitted TrainJob to its end: its conditions, its pods, their logs, and the API
//! server itself, in mflow's own state lines.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DynamicObject, ListParams};
use kube::runtime::watcher;
use kube::runtime::WatchStreamExt;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::api_status;
use crate::manifest::{NODE, POD_JOBSET_LABEL, POD_REPLICATED_JOB_LABEL};
use crate::state::{clock, excerpt};
use crate::{KubeBackend, KubeError, LogLine, Outcome, StageRequest};

mod follow;
use follow::Follow;

/// After this long without a pod, mflow says where to look.
const NO_POD_HINT: Duration = Duration::from_secs(30);
/// Changes of pod counts alone are said at most this often.
const COUNTS_EVERY: Duration = Duration::from_secs(5);
/// How often an API server that went away is asked whether it is back.
const OUTAGE_PROBE: Duration = Duration::from_secs(2);
/// How long the end of a TrainJob waits for pod events still on their way.
const PENDING_POD_EVENTS: Duration = Duration::from_millis(300);

impl KubeBackend {
    pub(crate) async fn watch(
        &self,
        api: &Api<DynamicObject>,
        req: &StageRequest,
        name: &str,
        logs: &mpsc::Sender<LogLine>,
        cancel: CancellationToken,
        detach: CancellationToken,
    ) -> Result<Outcome, KubeError> {
        let job_cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let mut jobs = watcher::watcher(api.clone(), job_cfg).default_backoff().boxed();
        let pods_api: Api<Pod> = Api::namespaced(self.client.clone(), self.namespace());
        let selector = format!("{POD_JOBSET_LABEL}={name},{POD_REPLICATED_JOB_LABEL}={NODE}");
        let mut pods =
            watcher::watcher(pods_api.clone(), watcher::Config::default().labels(&selector)).default_backoff().boxed();
        let mut f = Follow::new(self, api, req, name, logs, pods_api, selector);
        let mut poll = tokio::time::interval(self.opts.event_poll);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // A watch that resumed sends nothing until something changes: while the server is away,
        // asking it its version tells when it is back.
        let mut probe = tokio::time::interval(OUTAGE_PROBE);
        probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let due = f.shown.deadline();
            let end = tokio::select! {
                _ = cancel.cancelled() => Some(f.cancelled().await?),
                _ = detach.cancelled() => Some(f.detached().await),
                _ = probe.tick(), if f.outage.is_down() => { f.probe().await; None }
                _ = sleep_until(due), if due.is_some() => { f.say_due().await; None }
                _ = poll.tick(), if !f.start.started && !f.start.queued => f.starting().await,
                event = jobs.next() => f.job_event(event, &mut pods).await?,
                event = pods.next() => f.pod_event(event).await?,
            };
            if let Some(outcome) = end {
                return Ok(outcome);
            }
        }
    }

    /// Warning events of the TrainJob and of the objects named after it (its JobSet, Jobs and
    /// pods) not reported yet, as `pod X: Reason: message`. The same refusal for pods of other
    /// names (a Job retrying a pod a quota refuses) is said once. Events are advice: when they
    /// cannot be read, there are none.
    async fn new_warnings(&self, name: &str, warned: &mut BTreeSet<String>) -> Vec<String> {
        let events: Api<CoreEvent> = Api::namespaced(self.client.clone(), self.namespace());
        let Ok(list) = events.list(&ListParams::default().fields("type=Warning")).await else { return Vec::new() };
        let mut out = Vec::new();
        let prefix = format!("{name}-");
        let mut list = list.items;
        list.sort_by_key(|e| e.last_timestamp.clone().or(e.first_timestamp.clone()).map(|t| t.0));
        for e in list {
            let object = e.involved_object.name.clone().unwrap_or_default();
            if object != name && !object.starts_with(&prefix) {
                continue;
            }
            let kind = e.involved_object.kind.clone().unwrap_or_default().to_lowercase();
            let reason = e.reason.clone().unwrap_or_default();
            let message = excerpt(e.message.as_deref().unwrap_or_default(), 300);
            let text = format!("{kind} {object}: {reason}: {message}");
            if warned.insert(format!("{kind} {object}: {reason}: {}", without_pod_names(&message))) {
                out.push(text);
            }
        }
        out
    }

    /// Watch errors are retried by the watcher with backoff, except a permission refusal. The
    /// first error of an outage gives one line; the rest only go to the debug log.
    fn watch_error(
        &self,
        err: watcher::Error,
        resource: &str,
        outage: &mut Outage,
    ) -> Result<Option<String>, KubeError> {
        let status = match &err {
            watcher::Error::InitialListFailed(e) | watcher::Error::WatchStartFailed(e) => api_status(e).cloned(),
            watcher::Error::WatchError(s) => Some((**s).clone()),
            _ => None,
        };
        if let Some(s) = status.filter(|s| s.is_forbidden()) {
            return Err(KubeError::Forbidden {
                verb: "watch".into(),
                resource: resource.into(),
                namespace: Some(self.namespace().into()),
                rbac_namespace: self.namespace().into(),
                message: s.message,
            });
        }
        // A watch resumed from a version the server no longer keeps: the watcher lists again.
        if matches!(&err, watcher::Error::WatchError(s) if s.code == 410) {
            tracing::debug!("watch of {resource} expired; listing again");
            return Ok(None);
        }
        let text = match &err {
            watcher::Error::InitialListFailed(e)
            | watcher::Error::WatchStartFailed(e)
            | watcher::Error::WatchFailed(e) => crate::error::describe(e),
            other => other.to_string(),
        };
        tracing::debug!("watch of {resource} interrupted, retrying: {text}");
        Ok(outage.failed(&text))
    }
}

/// The API server going away and coming back, said once each.
pub(crate) struct Outage {
    url: String,
    since: Option<Instant>,
}

impl Outage {
    pub fn new(url: &str) -> Outage {
        Outage { url: url.to_string(), since: None }
    }

    pub fn failed(&mut self, error: &str) -> Option<String> {
        if self.since.is_some() {
            return None;
        }
        self.since = Some(Instant::now());
        Some(format!(
            "the API server at {} cannot be reached since {} ({}); mflow keeps trying, and the TrainJob runs on meanwhile",
            self.url,
            clock(Timestamp::now()),
            excerpt(error, 200)
        ))
    }

    pub fn is_down(&self) -> bool {
        self.since.is_some()
    }

    pub fn answered(&mut self) -> Option<String> {
        let since = self.since.take()?;
        Some(format!("the API server answers again, after {}; following on", humantime_secs(since.elapsed())))
    }
}

/// `pods "name-0-abcde" is forbidden` as `pods "…" is forbidden`: the same refusal, whatever the
/// pod's generated name.
fn without_pod_names(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(i) = rest.find("pods \"") {
        out.push_str(&rest[..i + 6]);
        rest = &rest[i + 6..];
        match rest.find('"') {
            Some(end) => {
                out.push('…');
                rest = &rest[end..];
            }
            None => break,
        }
    }
    out.push_str(rest);
    out
}

/// Where a resumed stage starts again: a train stage from the checkpoint its status file names
/// (on the artifact volume, which mflow sees at the same path), any other from the beginning.
fn resume_point(req: &StageRequest) -> String {
    if req.kind != "train" {
        return "from the beginning".into();
    }
    let iteration = req
        .env
        .get("MFLOW_STATUS")
        .and_then(|p| std::fs::read(p).ok())
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .and_then(|v| v.get("checkpoint_iteration")?.as_u64());
    match iteration {
        Some(n) => format!("from its newest checkpoint (iteration {n})"),
        None => "from the beginning (no checkpoint was saved before the suspension)".into(),
    }
}

async fn sleep_until(due: Option<Instant>) {
    match due {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

pub(crate) fn humantime_secs(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 60, s % 60) {
        (0, s) => format!("{s}s"),
        (m, 0) => format!("{m}m"),
        (m, s) => format!("{m}m{s}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_repeated_for_each_pod_name_is_one_warning() {
        let a = "Error creating: pods \"demo-train-node-0-0-x7k2p\" is forbidden: exceeded quota: q, requested: cpu=2";
        let b = "Error creating: pods \"demo-train-node-0-0-9qz4m\" is forbidden: exceeded quota: q, requested: cpu=2";
        assert_eq!(without_pod_names(a), without_pod_names(b));
        assert_eq!(
            without_pod_names(a),
            "Error creating: pods \"…\" is forbidden: exceeded quota: q, requested: cpu=2"
        );
        assert_eq!(without_pod_names("no pods here"), "no pods here");
    }

    #[tokio::test(start_paused = true)]
    async fn an_outage_is_said_once_and_its_end_once() {
        let mut outage = Outage::new("https://127.0.0.1:6443/");
        assert_eq!(outage.answered(), None);
        let first = outage.failed("error trying to connect: tcp connect error: Connection refused").expect("said");
        assert!(first.starts_with("the API server at https://127.0.0.1:6443/ cannot be reached since "), "{first}");
        assert!(first.contains("Connection refused") && first.contains("keeps trying"), "{first}");
        for _ in 0..20 {
            assert_eq!(outage.failed("Connection refused"), None);
        }
        tokio::time::advance(Duration::from_secs(42)).await;
        assert_eq!(outage.answered().as_deref(), Some("the API server answers again, after 42s; following on"));
        assert_eq!(outage.answered(), None);
    }
}
