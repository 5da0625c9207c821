//! Reading TrainJob conditions and pod status: what state a stage is in and why it failed.

use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;

use crate::manifest::{NODE, POD_RANK_LABEL};
use crate::FailureClass;

/// What a TrainJob's conditions say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobState {
    /// Suspended (for example waiting for Kueue admission).
    Queued,
    /// Not suspended and not finished; pods tell whether it is running.
    Active,
    Complete,
    Failed {
        reason: String,
        message: String,
    },
}

/// The state of a TrainJob from its `status.conditions` (Trainer sets only Suspended,
/// Complete and Failed).
pub fn job_state(trainjob: &Value) -> JobState {
    let conditions = trainjob.pointer("/status/conditions").and_then(Value::as_array);
    let is_true = |c: &&Value| c.get("status").and_then(Value::as_str) == Some("True");
    let find = |ty: &str| {
        conditions.into_iter().flatten().filter(is_true).find(|c| c.get("type").and_then(Value::as_str) == Some(ty))
    };
    if let Some(failed) = find("Failed") {
        let text = |k: &str| failed.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
        return JobState::Failed { reason: text("reason"), message: text("message") };
    }
    if find("Complete").is_some() {
        return JobState::Complete;
    }
    if find("Suspended").is_some() {
        return JobState::Queued;
    }
    JobState::Active
}

/// The node rank of a trainer pod, from the Indexed Job's completion index.
pub fn pod_rank(pod: &Pod) -> Option<u32> {
    let meta = &pod.metadata;
    meta.labels
        .as_ref()
        .and_then(|l| l.get(POD_RANK_LABEL))
        .or_else(|| meta.annotations.as_ref().and_then(|a| a.get(POD_RANK_LABEL)))
        .and_then(|v| v.parse().ok())
}

/// True when some container of the pod has started (so its log can be read).
pub fn node_container_started(pod: &Pod) -> Option<i32> {
    let status = pod.status.as_ref()?;
    let cs = status.container_statuses.as_ref()?.iter().find(|c| c.name == NODE)?;
    let state = cs.state.as_ref()?;
    (state.running.is_some() || state.terminated.is_some()).then_some(cs.restart_count)
}

/// A pod waiting on something that will not fix itself (a bad image name or config).
pub fn stuck_pod(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    for cs in status.container_statuses.iter().flatten() {
        if let Some(waiting) = cs.state.as_ref().and_then(|s| s.waiting.as_ref()) {
            let reason = waiting.reason.as_deref().unwrap_or_default();
            if matches!(reason, "InvalidImageName" | "CreateContainerConfigError" | "ErrImageNeverPull") {
                return Some(format!(
                    "{}{}: {}",
                    rank_prefix(pod),
                    reason,
                    waiting.message.as_deref().unwrap_or_default()
                ));
            }
        }
    }
    None
}

/// Exit codes of a container ended by a signal (SIGKILL, SIGTERM): what a deleted, evicted or
/// preempted pod's container exits with. mflow's driver Job restarts on them too.
pub const SIGNAL_EXIT_CODES: [i32; 2] = [137, 143];
/// The pod condition Kubernetes sets on a pod it is about to take away (eviction, preemption,
/// a tainted or lost node).
pub const DISRUPTION_CONDITION: &str = "DisruptionTarget";

/// Classifies a failed TrainJob from its Failed condition and its pods, given in the order
/// their ends were seen.
///
/// Evidence is weighed in this order: deadline (timeout); eviction, preemption or node loss of
/// any pod (infra: the other ranks' errors are consequences); a pod deleted while its
/// container ran, unless a rank had already failed on its own (then the deletion is JobSet
/// tearing the rest down); OOM kill (oom); a non-zero exit (user).
pub fn classify_failure(reason: &str, message: &str, pods: &[Pod]) -> (FailureClass, String) {
    if reason == "DeadlineExceeded" {
        // Trainer's message already says it ("TrainJob exceeded its active deadline").
        let message = if message.trim().is_empty() { "TrainJob exceeded its active deadline" } else { message.trim() };
        return (FailureClass::Timeout, format!("{message} (activeDeadlineSeconds)"));
    }
    for pod in pods {
        if let Some(why) = disruption(pod) {
            return (FailureClass::Infra, format!("{}{why}", rank_prefix(pod)));
        }
    }
    for pod in pods {
        if let Some(why) = deleted_while_running(pod) {
            return (FailureClass::Infra, format!("{}{why}", rank_prefix(pod)));
        }
        if terminated(pod).iter().any(|(_, t)| t.exit_code != 0) {
            break;
        }
    }
    for pod in pods {
        for (name, term) in terminated(pod) {
            if term.reason.as_deref() == Some("OOMKilled") {
                return (
                    FailureClass::Oom,
                    format!(
                        "{}container {name} was killed for exceeding its memory limit (OOMKilled)",
                        rank_prefix(pod)
                    ),
                );
            }
        }
    }
    // (torn down by a signal, rank, message): a rank killed because another failed is a
    // consequence, so real exits sort first.
    let mut exits: Vec<(bool, Option<u32>, String)> = Vec::new();
    for pod in pods {
        for (name, term) in terminated(pod) {
            if term.exit_code != 0 {
                let detail = term.message.as_deref().map(|m| format!(": {}", m.trim())).unwrap_or_default();
                exits.push((
                    SIGNAL_EXIT_CODES.contains(&term.exit_code),
                    pod_rank(pod),
                    format!(
                        "{}container {name} exited with code {}{}{detail}",
                        rank_prefix(pod),
                        term.exit_code,
                        signal_name(term.exit_code)
                    ),
                ));
            }
        }
    }
    if !exits.is_empty() {
        exits.sort();
        let first = exits.remove(0).2;
        let more = if exits.is_empty() { String::new() } else { format!(" (and {} more)", exits.len()) };
        return (FailureClass::User, format!("{first}{more}"));
    }
    if reason == "TrainingRuntimeNotSupported" {
        return (FailureClass::User, format!("runtime not supported: {message}"));
    }
    // The Job failed but its pods are gone or say nothing: count it as the cluster's fault,
    // so mflow's infra retry budget applies rather than the user's.
    (FailureClass::Infra, format!("TrainJob failed ({reason}): {message}"))
}

fn signal_name(code: i32) -> &'static str {
    match code {
        137 => " (SIGKILL)",
        143 => " (SIGTERM)",
        139 => " (SIGSEGV)",
        _ => "",
    }
}

fn rank_prefix(pod: &Pod) -> String {
    match pod_rank(pod) {
        Some(rank) => format!("rank {rank}: "),
        None => format!("pod {}: ", pod.metadata.name.as_deref().unwrap_or("?")),
    }
}

/// Set by the watch on its copy of a pod seen with a deletionTimestamp while its `node`
/// container ran; kept on the later copies of that pod.
pub(crate) const SEEN_DELETED_RUNNING: &str = "mflow.dev/seen-deleted-while-running";

/// When deletion of the pod was asked for: its deletionTimestamp less the grace period.
fn deletion_requested(pod: &Pod) -> Option<k8s_openapi::jiff::Timestamp> {
    let at = pod.metadata.deletion_timestamp.as_ref()?.0;
    let grace = pod.metadata.deletion_grace_period_seconds.unwrap_or(0);
    Some(at.checked_sub(k8s_openapi::jiff::SignedDuration::from_secs(grace)).unwrap_or(at))
}

/// True when the pod has a deletionTimestamp and its `node` container has not ended.
pub(crate) fn deleting_while_running(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some() && node_state(pod).is_some_and(|s| s.terminated.is_none())
}

fn node_state(pod: &Pod) -> Option<&k8s_openapi::api::core::v1::ContainerState> {
    let cs = pod.status.as_ref()?.container_statuses.as_ref()?.iter().find(|c| c.name == NODE)?;
    cs.state.as_ref()
}

/// A pod deleted (kubectl delete, a drain without eviction, an operator's cleanup) while its
/// `node` container ran: seen so by the watch, or its container ended after the deletion was
/// asked for. A container that had ended before is not a disruption.
pub fn deleted_while_running(pod: &Pod) -> Option<String> {
    let requested = deletion_requested(pod)?;
    let name = pod.metadata.name.as_deref().unwrap_or("?");
    let seen = pod.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(SEEN_DELETED_RUNNING));
    let state = node_state(pod);
    let Some(term) = state.and_then(|s| s.terminated.as_ref()) else {
        return (seen || state.is_some_and(|s| s.running.is_some()))
            .then(|| format!("pod {name} was deleted while its container ran"));
    };
    let after = term.finished_at.as_ref().is_some_and(|f| f.0 > requested);
    (seen || after).then(|| {
        format!(
            "pod {name} was deleted while its container ran (it then exited with code {}{})",
            term.exit_code,
            signal_name(term.exit_code)
        )
    })
}

/// Eviction, preemption or node loss, from the pod's reason and DisruptionTarget condition.
pub fn disruption(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    let name = pod.metadata.name.as_deref().unwrap_or("?");
    if let Some(reason) = status.reason.as_deref() {
        if matches!(reason, "Evicted" | "Preempting" | "NodeLost" | "NodeShutdown" | "Terminated" | "Shutdown") {
            let msg = status.message.as_deref().unwrap_or_default();
            return Some(format!("pod {name} {reason}: {msg}"));
        }
    }
    let cond = status.conditions.iter().flatten().find(|c| c.type_ == DISRUPTION_CONDITION && c.status == "True")?;
    let reason = cond.reason.as_deref().unwrap_or(DISRUPTION_CONDITION);
    let what = match reason {
        "EvictionByEvictionAPI" => "was evicted (Eviction API)",
        "PreemptionByScheduler" => "was preempted by the scheduler",
        "DeletionByTaintManager" => "was deleted because its node is tainted NoExecute",
        "DeletionByPodGC" => "was deleted by the pod garbage collector (its node is gone or not ready)",
        "TerminationByKubelet" => "was terminated by the kubelet",
        _ => "was disrupted",
    };
    Some(format!("pod {name} {what} ({reason}: {})", cond.message.as_deref().unwrap_or_default()))
}

fn terminated(pod: &Pod) -> Vec<(String, k8s_openapi::api::core::v1::ContainerStateTerminated)> {
    let Some(status) = pod.status.as_ref() else { return Vec::new() };
    status
        .container_statuses
        .iter()
        .flatten()
        .chain(status.init_container_statuses.iter().flatten())
        .filter_map(|cs| {
            let term = cs
                .state
                .as_ref()
                .and_then(|s| s.terminated.clone())
                .or_else(|| cs.last_state.as_ref().and_then(|s| s.terminated.clone()))?;
            Some((cs.name.clone(), term))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(rank: u32, status: Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": format!("job-node-0-{rank}-abcde"),
                         "labels": {"batch.kubernetes.io/job-completion-index": rank.to_string()}},
            "status": status,
        }))
        .unwrap()
    }

    fn exited(code: i32, reason: &str) -> Value {
        json!({"phase": "Failed", "containerStatuses": [{"name": "node", "ready": false, "restartCount": 0,
            "image": "i", "imageID": "", "state": {"terminated": {"exitCode": code, "reason": reason}}}]})
    }

    #[test]
    fn the_rank_that_failed_is_blamed_not_the_ones_torn_down() {
        let pods = [pod(0, exited(143, "Error")), pod(1, exited(2, "Error")), pod(2, exited(137, "Error"))];
        let (class, message) = classify_failure("FailedJobs", "", &pods);
        assert_eq!(class, FailureClass::User);
        assert_eq!(message, "rank 1: container node exited with code 2 (and 2 more)");
    }

    #[test]
    fn preemption_outranks_the_exit_codes_it_caused() {
        let mut preempted = exited(143, "Error");
        preempted["conditions"] = json!([{"type": "DisruptionTarget", "status": "True",
            "reason": "PreemptionByScheduler", "message": "Preempted by a higher priority pod"}]);
        let pods = [pod(0, exited(1, "Error")), pod(1, preempted)];
        let (class, message) = classify_failure("FailedJobs", "", &pods);
        assert_eq!(class, FailureClass::Infra);
        assert!(
            message.starts_with("rank 1: pod job-node-0-1-abcde was preempted by the scheduler (PreemptionByScheduler"),
            "{message}"
        );
    }

    fn deleted(mut pod: Pod, requested: &str, seen_running: bool) -> Pod {
        let at: k8s_openapi::jiff::Timestamp = requested.parse().unwrap();
        pod.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            at + k8s_openapi::jiff::SignedDuration::from_secs(30),
        ));
        pod.metadata.deletion_grace_period_seconds = Some(30);
        if seen_running {
            pod.metadata.annotations = Some([(SEEN_DELETED_RUNNING.to_string(), "true".to_string())].into());
        }
        pod
    }

    fn killed_at(code: i32, at: &str) -> Value {
        json!({"phase": "Failed", "containerStatuses": [{"name": "node", "ready": false, "restartCount": 0, "image": "i",
            "imageID": "", "state": {"terminated": {"exitCode": code, "reason": "Error", "finishedAt": at}}}]})
    }

    #[test]
    fn a_pod_deleted_while_its_container_ran_is_a_disruption_whatever_its_exit_code() {
        // Seen with a deletionTimestamp while running; torchrun may exit 1 on SIGTERM.
        for code in [137, 143, 1] {
            let pod = deleted(pod(0, killed_at(code, "2026-01-01T00:00:01Z")), "2026-01-01T00:00:01Z", true);
            let (class, message) = classify_failure("FailedJobs", "", &[pod]);
            assert_eq!(class, FailureClass::Infra, "{message}");
            assert!(
                message.starts_with(
                    "rank 0: pod job-node-0-0-abcde was deleted while its container ran (it then exited with code"
                ),
                "{message}"
            );
        }
        // Not seen running (mflow came back later), but killed after the deletion was asked.
        let later = deleted(pod(0, killed_at(137, "2026-01-01T00:00:31Z")), "2026-01-01T00:00:01Z", false);
        let (class, message) = classify_failure("FailedJobs", "", &[later]);
        assert_eq!(class, FailureClass::Infra, "{message}");
        assert!(message.contains("exited with code 137 (SIGKILL)"), "{message}");
        // Gone while running, as kwok deletes pods: its last status is a running container.
        let running = json!({"phase": "Running", "containerStatuses": [{"name": "node", "ready": true, "restartCount": 0,
            "image": "i", "imageID": "", "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]});
        let (class, message) =
            classify_failure("FailedJobs", "", &[deleted(pod(0, running), "2026-01-01T00:00:01Z", false)]);
        assert_eq!(
            (class, message.as_str()),
            (FailureClass::Infra, "rank 0: pod job-node-0-0-abcde was deleted while its container ran")
        );
    }

    #[test]
    fn pods_deleted_after_a_rank_failed_on_its_own_are_its_consequence() {
        // Rank 1 fails; JobSet then deletes the Job, and with it rank 0 (running) and rank 1.
        let failed = deleted(pod(1, killed_at(2, "2026-01-01T00:00:01Z")), "2026-01-01T00:00:01Z", false);
        let torn_down = deleted(pod(0, killed_at(143, "2026-01-01T00:00:02Z")), "2026-01-01T00:00:01Z", true);
        let (class, message) = classify_failure("FailedJobs", "", &[failed, torn_down]);
        assert_eq!(class, FailureClass::User, "{message}");
        assert!(message.starts_with("rank 1: container node exited with code 2"), "{message}");
        // A container that had ended before anyone deleted its pod failed on its own.
        let before = deleted(pod(0, killed_at(137, "2026-01-01T00:00:01Z")), "2026-01-01T00:05:00Z", false);
        assert_eq!(classify_failure("FailedJobs", "", &[before]).0, FailureClass::User);
    }

    #[test]
    fn a_failure_without_evidence_counts_as_infra_and_a_deadline_as_timeout() {
        assert_eq!(classify_failure("FailedJobs", "jobset failed", &[]).0, FailureClass::Infra);
        assert_eq!(classify_failure("DeadlineExceeded", "", &[pod(0, exited(1, "Error"))]).0, FailureClass::Timeout);
    }

    #[test]
    fn conditions_give_the_state() {
        let job = |conds: Value| json!({"status": {"conditions": conds}});
        assert_eq!(job_state(&json!({})), JobState::Active);
        assert_eq!(job_state(&job(json!([{"type": "Suspended", "status": "True"}]))), JobState::Queued);
        assert_eq!(job_state(&job(json!([{"type": "Suspended", "status": "False"}]))), JobState::Active);
        assert_eq!(job_state(&job(json!([{"type": "Complete", "status": "True"}]))), JobState::Complete);
        assert!(matches!(
            job_state(&job(json!([{"type": "Suspended", "status": "False"}, {"type": "Failed", "status": "True", "reason": "FailedJobs"}]))),
            JobState::Failed { ref reason, .. } if reason == "FailedJobs"
        ));
    }
}
