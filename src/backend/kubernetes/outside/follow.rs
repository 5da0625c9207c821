//! Following a driver from outside the cluster: its pods' logs are the engine's
//! `--log-format json` events, rendered here as a local run renders them; its end is the
//! engine's exit code.

use std::collections::HashSet;
use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};

use super::events::Follower;
use super::RemoteError;
use crate::exit::ExitCode;
use mflow_kube::driver::{job_name, CONTAINER};

/// How a followed driver ended.
pub enum End {
    Exited(ExitCode),
    /// Its restarts ran out after evictions or node losses.
    RestartsRanOut(String),
    /// The container never ran mflow (exit code and reason of the container).
    NotMflow(String),
}

pub async fn follow(client: kube::Client, namespace: &str, run: &str, display: &Follower) -> Result<End, RemoteError> {
    let jobs: Api<Job> = Api::namespaced(client.clone(), namespace);
    let pods: Api<Pod> = Api::namespaced(client, namespace);
    let name = job_name(run);
    let kube = |what: &str| {
        let what = what.to_string();
        move |e: kube::Error| RemoteError::call(what.clone(), &e)
    };
    let mut followed: HashSet<String> = HashSet::new();
    let mut said: HashSet<String> = HashSet::new();
    loop {
        let job = jobs
            .get_opt(&name)
            .await
            .map_err(kube("read the driver Job"))?
            .ok_or_else(|| RemoteError::NoRun { run: run.to_string(), namespace: namespace.to_string() })?;
        let mut listed = pods
            .list(&ListParams::default().labels(&format!("job-name={name}")))
            .await
            .map_err(kube("list the driver's pods"))?
            .items;
        listed.sort_by_key(|p| p.metadata.creation_timestamp.clone());
        if let Some(end) = finished(&job, &listed) {
            // Lines of a pod that ended before it was followed are shown first.
            if let Some(p) =
                listed.iter().rev().find(|p| !followed.contains(p.metadata.name.as_deref().unwrap_or_default()))
            {
                let pod = p.metadata.name.clone().unwrap_or_default();
                let _ = super::volume::follow_log(&pods, &pod, CONTAINER, |l| display.line(l)).await;
            }
            display.finish();
            return Ok(end);
        }
        let Some(pod) = listed.iter().find(|p| !followed.contains(p.metadata.name.as_deref().unwrap_or_default()))
        else {
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        let pod_name = pod.metadata.name.clone().unwrap_or_default();
        let status = pod.status.clone().unwrap_or_default();
        if let Some(w) = status.container_statuses.iter().flatten().find_map(|c| c.state.as_ref()?.waiting.clone()) {
            let reason = w.reason.unwrap_or_default();
            if matches!(reason.as_str(), "ErrImagePull" | "ImagePullBackOff" | "InvalidImageName" | "ErrImageNeverPull")
            {
                let image = pod.spec.as_ref().and_then(|s| s.containers.first()?.image.clone()).unwrap_or_default();
                return Err(RemoteError::Image {
                    image,
                    reason: format!("{reason}: {}", w.message.unwrap_or_default()),
                });
            }
            if !reason.is_empty() && said.insert(format!("{pod_name}/{reason}")) {
                crate::errln!("driver pod {pod_name}: {reason}");
            }
        }
        let started = status
            .container_statuses
            .iter()
            .flatten()
            .any(|c| c.state.as_ref().is_some_and(|s| s.running.is_some() || s.terminated.is_some()));
        if !started {
            if let Some(c) =
                status.conditions.iter().flatten().find(|c| c.type_ == "PodScheduled" && c.status == "False")
            {
                let msg = c.message.clone().unwrap_or_default();
                if said.insert(format!("{pod_name}/{msg}")) {
                    crate::errln!("driver pod {pod_name}: not scheduled: {msg}");
                }
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        if !followed.is_empty() {
            crate::errln!("driver restarted: following pod {pod_name}");
        }
        followed.insert(pod_name.clone());
        if let Err(e) = super::volume::follow_log(&pods, &pod_name, CONTAINER, |l| display.line(l)).await {
            tracing::debug!(error = %e, pod = pod_name, "driver log stream ended");
        }
        display.flush();
    }
}

/// The end of a Job that the controller has decided, with the exit code of its last pod.
fn finished(job: &Job, pods: &[Pod]) -> Option<End> {
    let conds = job.status.as_ref()?.conditions.as_ref()?;
    let cond = |t: &str| conds.iter().find(|c| c.type_ == t && c.status == "True");
    if cond("Complete").is_some() {
        return Some(End::Exited(ExitCode::Success));
    }
    let failed = cond("Failed")?;
    let last = pods.iter().rev().find_map(|p| {
        let s = p.status.as_ref()?.container_statuses.as_ref()?.iter().find(|c| c.name == CONTAINER)?;
        s.state.as_ref()?.terminated.clone()
    });
    Some(match failed.reason.as_deref() {
        Some("PodFailurePolicy") => match last.as_ref().and_then(|t| ExitCode::from_code(t.exit_code)) {
            Some(code) => End::Exited(code),
            None => End::NotMflow(match last {
                Some(t) => format!(
                    "exit code {}: {} {}",
                    t.exit_code,
                    t.reason.unwrap_or_default(),
                    t.message.unwrap_or_default()
                ),
                None => failed.message.clone().unwrap_or_default(),
            }),
        },
        _ => End::RestartsRanOut(failed.message.clone().unwrap_or_else(|| failed.reason.clone().unwrap_or_default())),
    })
}
