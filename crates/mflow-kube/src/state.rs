//! What a TrainJob's pods say, in the words of mflow's state lines, and how often it is said.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use tokio::time::Instant;

use crate::classify::{deleting_while_running, node_container_started, pod_rank, SEEN_DELETED_RUNNING};
use crate::manifest::NODE;

/// The trainer pods as last seen (deleted ones too: their status explains a failure), and the
/// order in which their ends were seen (a deletion, a disruption or an exit), which tells a
/// cause from its consequences.
#[derive(Default)]
pub(crate) struct SeenPods {
    pods: BTreeMap<String, Seen>,
    ends: Vec<String>,
}

struct Seen {
    pod: Pod,
    /// Its deletion was seen: it no longer counts as one of the TrainJob's pods.
    gone: bool,
}

impl SeenPods {
    /// Records a pod event; `gone` for a deletion.
    pub fn observe(&mut self, mut pod: Pod, gone: bool) {
        let Some(name) = pod.metadata.name.clone() else { return };
        let marked = |p: &Pod| p.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(SEEN_DELETED_RUNNING));
        let same = |p: &Pod| p.metadata.uid == pod.metadata.uid;
        if deleting_while_running(&pod) || self.pods.get(&name).is_some_and(|old| marked(&old.pod) && same(&old.pod)) {
            pod.metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(SEEN_DELETED_RUNNING.into(), "true".into());
        }
        let ended = gone
            || pod.metadata.deletion_timestamp.is_some()
            || node_container_ended(&pod)
            || matches!(phase(&pod), "Succeeded" | "Failed");
        if ended && !self.ends.contains(&name) {
            self.ends.push(name.clone());
        }
        self.pods.insert(name, Seen { pod, gone });
    }

    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    pub fn any_started(&self) -> bool {
        self.pods.values().any(|s| pod_started(&s.pod))
    }

    /// Pods whose ends were seen first, in that order, then the others.
    pub fn in_order_of_ends(mut self) -> Vec<Pod> {
        let mut out: Vec<Pod> = self.ends.iter().filter_map(|n| self.pods.remove(n)).map(|s| s.pod).collect();
        out.extend(self.pods.into_values().map(|s| s.pod));
        out
    }

    /// Pods that are not deleted nor being deleted.
    fn live(&self) -> impl Iterator<Item = &Pod> {
        self.pods.values().filter(|s| !s.gone && s.pod.metadata.deletion_timestamp.is_none()).map(|s| &s.pod)
    }

    /// The state line of the TrainJob from its pods. Once a pod has started, the state never
    /// falls back to `pending`: pods that finished wait for the TrainJob's condition.
    pub fn state(&self, nodes: u32, started: bool, now: Timestamp) -> State {
        let troubles: Vec<(String, String)> =
            self.pods.values().filter(|s| !s.gone).filter_map(|s| trouble(&s.pod, now)).collect();
        let running = self.live().filter(|p| phase(p) == "Running" && !not_ready(p)).count();
        let finished = self.live().filter(|p| matches!(phase(p), "Succeeded" | "Failed")).count();
        let (key, mut text) = if running > 0 {
            ("running".to_string(), format!("running on {running}/{nodes} nodes"))
        } else if finished > 0 {
            ("finished".into(), format!("pods finished on {finished}/{nodes} nodes; waiting for the TrainJob's status"))
        } else if started && !troubles.is_empty() {
            ("running".into(), format!("running on 0/{nodes} nodes"))
        } else if started {
            ("starting".into(), "starting".into())
        } else if let Some(why) = self.live().find_map(unschedulable) {
            (format!("unschedulable {why}"), format!("pending: cannot be scheduled yet ({why})"))
        } else {
            match self.live().find_map(waiting_reason) {
                Some(why) => (format!("pending {why}"), format!("pending: {why}")),
                None => ("pending".into(), "pending".into()),
            }
        };
        let mut key = key;
        for (k, t) in &troubles {
            key.push('|');
            key.push_str(k);
            text.push_str("; ");
            text.push_str(t);
        }
        State { key, text }
    }
}

/// A state line, and what makes it a new state rather than new counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct State {
    pub key: String,
    pub text: String,
}

/// Says every change of state at once, and changes of counts alone (pods starting one by one on
/// many nodes) at most once every `every`, the latest of them.
pub(crate) struct Coalesce {
    every: Duration,
    said: Option<State>,
    at: Option<Instant>,
    pending: Option<State>,
}

impl Coalesce {
    pub fn new(every: Duration) -> Coalesce {
        Coalesce { every, said: None, at: None, pending: None }
    }

    /// The line to say now, if any; a count change that comes too soon waits for [`Self::due`].
    pub fn offer(&mut self, state: State) -> Option<String> {
        if self.said.as_ref() == Some(&state) {
            self.pending = None;
            return None;
        }
        let transition = self.said.as_ref().is_none_or(|s| s.key != state.key);
        if transition || self.at.is_none_or(|t| t.elapsed() >= self.every) {
            return Some(self.say(state));
        }
        self.pending = Some(state);
        None
    }

    /// When the waiting line is due.
    pub fn deadline(&self) -> Option<Instant> {
        self.pending.as_ref().and(self.at).map(|t| t + self.every)
    }

    /// The waiting line, once due.
    pub fn due(&mut self) -> Option<String> {
        let state = self.pending.take()?;
        Some(self.say(state))
    }

    /// The newest state, said or waiting.
    pub fn latest(&self) -> Option<&str> {
        self.pending.as_ref().or(self.said.as_ref()).map(|s| s.text.as_str())
    }

    fn say(&mut self, state: State) -> String {
        self.pending = None;
        self.at = Some(Instant::now());
        let text = state.text.clone();
        self.said = Some(state);
        text
    }
}

/// What is wrong with a pod that the count of running pods does not show: it is being deleted
/// (and its node does not confirm it stopped), or its node stopped reporting. (key, words).
fn trouble(pod: &Pod, now: Timestamp) -> Option<(String, String)> {
    let name = pod.metadata.name.as_deref().unwrap_or("?");
    let who = match pod_rank(pod) {
        Some(rank) => format!("rank {rank} (pod {name})"),
        None => format!("pod {name}"),
    };
    let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()).unwrap_or("?");
    let ready = ready_condition(pod);
    let node_down = ready.is_some_and(|(status, _)| status != "True");
    if let Some(deadline) = pod.metadata.deletion_timestamp.as_ref().map(|t| t.0) {
        if !deleting_while_running(pod) {
            return None;
        }
        let grace = pod.metadata.deletion_grace_period_seconds.unwrap_or(0);
        let asked = deadline.checked_sub(k8s_openapi::jiff::SignedDuration::from_secs(grace)).unwrap_or(deadline);
        if now <= deadline {
            return Some((format!("{who} terminating"), format!("{who} is being deleted (since {})", clock(asked))));
        }
        let why = if node_down {
            format!("its node {node} is not ready, so nothing confirms that the container stopped")
        } else {
            format!("its node {node} has not confirmed that the container stopped")
        };
        return Some((format!("{who} stuck"), format!("{who} is stuck terminating since {}: {why}", clock(asked))));
    }
    let running = phase(pod) == "Running" && node_container_running(pod);
    match ready {
        Some((_, since)) if running && node_down => {
            let since = since.map(|t| format!(" since {}", clock(t))).unwrap_or_default();
            Some((
                format!("{who} not ready"),
                format!("{who} is not ready{since}: its node {node} stopped reporting the pod (the container may still run)"),
            ))
        }
        _ => None,
    }
}

/// A pod marked not ready while its container runs: mflow's pods have no readiness probes, so
/// this is the node controller's word that the node stopped reporting. (A container that ended
/// makes its pod not ready too; that is not this.)
fn not_ready(pod: &Pod) -> bool {
    ready_condition(pod).is_some_and(|(status, _)| status != "True") && node_container_running(pod)
}

/// The `node` container was last reported running.
fn node_container_running(pod: &Pod) -> bool {
    let statuses = pod.status.as_ref().and_then(|s| s.container_statuses.as_ref());
    statuses.into_iter().flatten().any(|c| c.name == NODE && c.state.as_ref().is_some_and(|s| s.running.is_some()))
}

fn ready_condition(pod: &Pod) -> Option<(&str, Option<Timestamp>)> {
    let cond = pod.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == "Ready")?;
    Some((cond.status.as_str(), cond.last_transition_time.as_ref().map(|t| t.0)))
}

/// `21:04:05 UTC`
pub(crate) fn clock(t: Timestamp) -> String {
    t.strftime("%H:%M:%S UTC").to_string()
}

/// A pod whose container has started, or that has run to its end.
pub(crate) fn pod_started(pod: &Pod) -> bool {
    node_container_started(pod).is_some() || matches!(phase(pod), "Running" | "Succeeded" | "Failed")
}

fn node_container_ended(pod: &Pod) -> bool {
    let statuses = pod.status.as_ref().and_then(|s| s.container_statuses.as_ref());
    statuses.into_iter().flatten().any(|c| c.name == NODE && c.state.as_ref().is_some_and(|s| s.terminated.is_some()))
}

/// Why a pod's container waits (an image pull, a sandbox), when the kubelet says.
fn waiting_reason(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    status.container_statuses.iter().flatten().find_map(|cs| {
        let waiting = cs.state.as_ref()?.waiting.as_ref()?;
        let reason = waiting.reason.as_deref().filter(|r| *r != "ContainerCreating")?;
        Some(format!("{reason}: {}", excerpt(waiting.message.as_deref().unwrap_or_default(), 300)))
    })
}

/// The scheduler's reason for not placing a pod (missing GPUs, taints, ...).
fn unschedulable(pod: &Pod) -> Option<String> {
    let cond = pod.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == "PodScheduled")?;
    (cond.status == "False").then(|| cond.message.clone().or_else(|| cond.reason.clone()).unwrap_or_default())
}

pub(crate) fn phase(pod: &Pod) -> &str {
    pod.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("Pending")
}

/// At most `max` characters of a message from the cluster, on one line.
pub(crate) fn excerpt(text: &str, max: usize) -> String {
    let one_line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match one_line.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &one_line[..cut]),
        None => one_line,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, rank: u32, extra: serde_json::Value) -> Pod {
        let mut v = json!({
            "metadata": {"name": name, "uid": format!("uid-{name}"),
                         "labels": {"batch.kubernetes.io/job-completion-index": rank.to_string()}},
            "spec": {"nodeName": "gpu-7", "containers": [{"name": "node"}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [{"name": "node", "ready": true, "restartCount": 0, "image": "i", "imageID": "",
                    "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]},
        });
        merge(&mut v, extra);
        serde_json::from_value(v).unwrap()
    }

    fn merge(a: &mut serde_json::Value, b: serde_json::Value) {
        match (a, b) {
            (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
                for (k, v) in b {
                    merge(a.entry(k).or_insert(serde_json::Value::Null), v);
                }
            }
            (a, b) => *a = b,
        }
    }

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn deleted_pods_are_not_counted_as_running() {
        // Suspended, then resumed: the old pods went, new ones run.
        let mut seen = SeenPods::default();
        seen.observe(pod("a", 0, json!({})), false);
        seen.observe(pod("b", 1, json!({})), false);
        seen.observe(pod("a", 0, json!({})), true);
        seen.observe(pod("b", 1, json!({})), true);
        seen.observe(pod("c", 0, json!({"metadata": {"uid": "uid-c2"}})), false);
        let state = seen.state(2, true, at("2026-01-01T00:01:00Z"));
        assert_eq!(state.text, "running on 1/2 nodes");
    }

    #[test]
    fn a_container_that_ended_is_not_a_node_that_stopped_reporting() {
        // The kubelet reports the exit: the pod is not ready, its phase still Running.
        let ended = json!({"status": {"conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": "2026-01-01T00:00:40Z"}],
            "containerStatuses": [{"name": "node", "ready": false, "restartCount": 0, "image": "i", "imageID": "",
                "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}]}});
        let mut seen = SeenPods::default();
        seen.observe(pod("p", 0, ended), false);
        let state = seen.state(1, true, at("2026-01-01T00:01:00Z"));
        assert!(!state.text.contains("not ready"), "{}", state.text);
    }

    #[test]
    fn a_pod_stuck_terminating_on_a_node_that_stopped_reporting_is_said() {
        let mut seen = SeenPods::default();
        let not_ready = json!({"status": {"conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": "2026-01-01T00:00:40Z"}]}});
        seen.observe(pod("p", 0, not_ready.clone()), false);
        let state = seen.state(1, true, at("2026-01-01T00:01:00Z"));
        assert_eq!(
            state.text,
            "running on 0/1 nodes; rank 0 (pod p) is not ready since 00:00:40 UTC: its node gpu-7 stopped reporting the pod (the container may still run)"
        );
        // The taint manager deletes it; the kubelet never confirms.
        let mut deleting = not_ready;
        merge(
            &mut deleting,
            json!({"metadata": {"deletionTimestamp": "2026-01-01T00:06:10Z", "deletionGracePeriodSeconds": 30}}),
        );
        seen.observe(pod("p", 0, deleting), false);
        let early = seen.state(1, true, at("2026-01-01T00:06:00Z"));
        assert!(early.text.ends_with("rank 0 (pod p) is being deleted (since 00:05:40 UTC)"), "{}", early.text);
        let late = seen.state(1, true, at("2026-01-01T00:09:00Z"));
        assert_eq!(
            late.text,
            "running on 0/1 nodes; rank 0 (pod p) is stuck terminating since 00:05:40 UTC: its node gpu-7 is not ready, so nothing confirms that the container stopped"
        );
        assert_ne!(early.key, late.key, "getting stuck is a change of state");
    }

    #[tokio::test(start_paused = true)]
    async fn count_changes_are_coalesced_and_transitions_said_at_once() {
        let mut c = Coalesce::new(Duration::from_secs(5));
        let st = |key: &str, text: &str| State { key: key.into(), text: text.into() };
        assert_eq!(c.offer(st("running", "running on 1/128 nodes")).as_deref(), Some("running on 1/128 nodes"));
        for n in 2..=100 {
            assert_eq!(c.offer(st("running", &format!("running on {n}/128 nodes"))), None);
        }
        assert_eq!(c.latest(), Some("running on 100/128 nodes"));
        let deadline = c.deadline().expect("a line waits");
        tokio::time::sleep_until(deadline).await;
        assert_eq!(c.due().as_deref(), Some("running on 100/128 nodes"));
        assert_eq!(c.offer(st("running", "running on 101/128 nodes")), None);
        // A new state is said at once, and the waiting count with it is dropped.
        assert_eq!(
            c.offer(st("finished", "pods finished on 128/128 nodes")).as_deref(),
            Some("pods finished on 128/128 nodes")
        );
        assert_eq!(c.deadline(), None);
        assert_eq!(c.offer(st("finished", "pods finished on 128/128 nodes")), None, "the same line is not said twice");
    }
}
