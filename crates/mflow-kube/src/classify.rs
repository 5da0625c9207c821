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
    Failed { reason: String, message: String },
}

/// The state of a TrainJob from its `status.conditions` (Trainer sets only Suspended,
/// Complete and Failed).
pub fn job_state(trainjob: &Value) -> JobState {
    let conditions = trainjob.pointer("/status/conditions").and_then(Value::as_array);
    let is_true = |c: &&Value| c.get("status").and_then(Value::as_str) == Some("True");
    let find = |ty: &str| {
        conditions
            .into_iter()
            .flatten()
            .filter(is_true)
            .find(|c| c.get("type").and_then(Value::as_str) == Some(ty))
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

/// Classifies a failed TrainJob from its Failed condition and its pods.
///
/// Evidence is weighed in this order: deadline (timeout), disruption of any pod (infra: the
/// other ranks' errors are consequences), OOM kill (oom), a non-zero exit (user).
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
        for (name, term) in terminated(pod) {
            if term.reason.as_deref() == Some("OOMKilled") {
                return (
                    FailureClass::Oom,
                    format!("{}container {name} was killed for exceeding its memory limit (OOMKilled)", rank_prefix(pod)),
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
                let signal = match term.exit_code {
                    137 => " (SIGKILL)",
                    143 => " (SIGTERM)",
                    139 => " (SIGSEGV)",
                    _ => "",
                };
                let detail = term.message.as_deref().map(|m| format!(": {}", m.trim())).unwrap_or_default();
                exits.push((
                    matches!(term.exit_code, 137 | 143),
                    pod_rank(pod),
                    format!("{}container {name} exited with code {}{signal}{detail}", rank_prefix(pod), term.exit_code),
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

fn rank_prefix(pod: &Pod) -> String {
    match pod_rank(pod) {
        Some(rank) => format!("rank {rank}: "),
        None => format!("pod {}: ", pod.metadata.name.as_deref().unwrap_or("?")),
    }
}

/// Eviction, preemption or node loss, from the pod's reason and DisruptionTarget condition.
fn disruption(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    if let Some(reason) = status.reason.as_deref() {
        if matches!(reason, "Evicted" | "Preempting" | "NodeLost" | "NodeShutdown" | "Terminated" | "Shutdown") {
            let msg = status.message.as_deref().unwrap_or_default();
            return Some(format!("pod {reason}: {msg}"));
        }
    }
    let cond = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "DisruptionTarget" && c.status == "True")?;
    Some(format!(
        "pod disrupted ({}): {}",
        cond.reason.as_deref().unwrap_or("DisruptionTarget"),
        cond.message.as_deref().unwrap_or_default()
    ))
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
        assert!(message.starts_with("rank 1: pod disrupted (PreemptionByScheduler)"), "{message}");
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
