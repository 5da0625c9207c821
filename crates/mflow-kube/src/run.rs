//! Submitting a stage's TrainJob (or reattaching to it) and watching it to the end.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backend::trainjob_resource;
use crate::classify::{classify_failure, job_state, stuck_pod, JobState};
use crate::error::api_status;
use crate::logs::LogFollower;
use crate::manifest::{
    trainjob_manifest, validate_request, ANN_KEY, ANN_PIPELINE, ANN_STAGE, LABEL_ATTEMPT, LABEL_MANAGED_BY, MANAGED_BY,
    NODE, POD_JOBSET_LABEL, POD_REPLICATED_JOB_LABEL,
};
use crate::names::trainjob_name;
use crate::{FailureClass, KubeBackend, KubeError, LogLine, Outcome, StageRequest};

/// A TrainJob found for an attempt before running it (see [`KubeBackend::existing`]).
#[derive(Debug, Clone)]
pub struct Existing {
    pub name: String,
    pub env: BTreeMap<String, String>,
    pub state: JobState,
}

/// Longest wait for a deleted TrainJob to disappear before resubmitting under its name.
const DELETE_WAIT: Duration = Duration::from_secs(120);

/// Sends mflow's own state lines; a closed receiver only means nobody is listening.
struct Say<'a>(&'a mpsc::Sender<LogLine>);

impl Say<'_> {
    async fn line(&self, text: String) {
        let _ = self.0.send(LogLine { rank: None, line: format!("mflow: {text}") }).await;
    }
}

impl KubeBackend {
    /// Runs one stage attempt to its end (see the crate docs for reattach and cancel rules).
    pub async fn run(
        &self,
        req: &StageRequest,
        logs: mpsc::Sender<LogLine>,
        cancel: CancellationToken,
    ) -> Result<Outcome, KubeError> {
        validate_request(req)?;
        let name = trainjob_name(&req.pipeline, &req.stage, &req.key, req.attempt);
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), self.namespace(), &trainjob_resource());
        let say = Say(&logs);

        match api.get_opt(&name).await.map_err(|e| self.call_err(e, "get", "trainjobs", &name))? {
            Some(existing) => {
                check_ownership(&existing, req, &name)?;
                match job_state(&to_value(&existing)) {
                    JobState::Complete => {
                        say.line(format!("TrainJob {name} already completed")).await;
                        return Ok(Outcome::Succeeded);
                    }
                    JobState::Failed { .. } => {
                        say.line(format!("deleting TrainJob {name}, which failed in an earlier run")).await;
                        self.delete_and_wait(&api, &name).await?;
                        self.submit(&api, req, &name).await?;
                        say.line(format!("submitted TrainJob {name}")).await;
                    }
                    _ => say.line(format!("reattaching to TrainJob {name}")).await,
                }
            }
            None => {
                self.submit(&api, req, &name).await?;
                say.line(format!("submitted TrainJob {name}")).await;
            }
        }
        self.watch(&api, req, &name, &logs, cancel).await
    }

    /// The TrainJob of this attempt left by an earlier mflow process, if mflow created it for
    /// exactly this stage, key and attempt: its environment and whether it already completed.
    /// The engine uses it to find where that TrainJob writes its output before reattaching.
    pub async fn existing(&self, req: &StageRequest) -> Result<Option<Existing>, KubeError> {
        let name = trainjob_name(&req.pipeline, &req.stage, &req.key, req.attempt);
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), self.namespace(), &trainjob_resource());
        let Some(obj) = api.get_opt(&name).await.map_err(|e| self.call_err(e, "get", "trainjobs", &name))? else {
            return Ok(None);
        };
        if check_ownership(&obj, req, &name).is_err() {
            return Ok(None);
        }
        let value = to_value(&obj);
        let env = value
            .pointer("/spec/trainer/env")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|v| Some((v.get("name")?.as_str()?.to_string(), v.get("value")?.as_str()?.to_string())))
            .collect();
        let state = job_state(&value);
        Ok(Some(Existing { name, env, state }))
    }

    /// Deletes this attempt's own TrainJob (one whose result cannot be used), waiting until it
    /// is gone; a foreign object of that name is left alone and reported.
    pub async fn forget(&self, req: &StageRequest) -> Result<(), KubeError> {
        let name = trainjob_name(&req.pipeline, &req.stage, &req.key, req.attempt);
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), self.namespace(), &trainjob_resource());
        match api.get_opt(&name).await.map_err(|e| self.call_err(e, "get", "trainjobs", &name))? {
            Some(obj) => {
                check_ownership(&obj, req, &name)?;
                self.delete_and_wait(&api, &name).await
            }
            None => Ok(()),
        }
    }

    /// Sends this attempt's TrainJob as a server-side dry run (`dryRun=All`): the API server and
    /// Trainer's admission check it as they would a real submission, and nothing is stored.
    /// An existing TrainJob of that name is not an error when mflow owns it (a run would
    /// reattach); a foreign one is.
    pub async fn dry_run(&self, req: &StageRequest) -> Result<(), KubeError> {
        validate_request(req)?;
        let name = trainjob_name(&req.pipeline, &req.stage, &req.key, req.attempt);
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), self.namespace(), &trainjob_resource());
        self.create(&api, req, &name, true).await
    }

    async fn submit(&self, api: &Api<DynamicObject>, req: &StageRequest, name: &str) -> Result<(), KubeError> {
        self.create(api, req, name, false).await
    }

    async fn create(&self, api: &Api<DynamicObject>, req: &StageRequest, name: &str, dry_run: bool) -> Result<(), KubeError> {
        let manifest = trainjob_manifest(req, &self.opts);
        let object: DynamicObject = serde_json::from_value(manifest).map_err(|e| KubeError::Invalid {
            stage: req.stage.clone(),
            kind: "TrainJob".into(),
            name: name.into(),
            message: e.to_string(),
        })?;
        match api.create(&PostParams { dry_run, ..PostParams::default() }, &object).await {
            Ok(_) => Ok(()),
            Err(e) => match api_status(&e) {
                // Created meanwhile (another mflow process): ours means attach, else refuse.
                Some(s) if s.is_already_exists() || s.code == 409 => {
                    let existing = api.get(name).await.map_err(|e| self.call_err(e, "get", "trainjobs", name))?;
                    check_ownership(&existing, req, name)
                }
                Some(s) if s.is_invalid() || s.code == 400 => Err(KubeError::Invalid {
                    stage: req.stage.clone(),
                    kind: "TrainJob".into(),
                    name: name.into(),
                    message: s.message.clone(),
                }),
                _ => Err(self.call_err(e, "create", "trainjobs", name)),
            },
        }
    }

    async fn delete_and_wait(&self, api: &Api<DynamicObject>, name: &str) -> Result<(), KubeError> {
        match api.delete(name, &DeleteParams::background()).await {
            Ok(_) => {}
            Err(e) if api_status(&e).is_some_and(|s| s.is_not_found()) => return Ok(()),
            Err(e) => return Err(self.call_err(e, "delete", "trainjobs", name)),
        }
        let deadline = tokio::time::Instant::now() + DELETE_WAIT;
        while api.get_opt(name).await.map_err(|e| self.call_err(e, "get", "trainjobs", name))?.is_some() {
            if tokio::time::Instant::now() > deadline {
                return Err(KubeError::Api {
                    verb: "delete".into(),
                    resource: "trainjobs".into(),
                    name: name.into(),
                    message: format!("still present {DELETE_WAIT:?} after deletion (a finalizer may be stuck)"),
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(())
    }

    async fn watch(
        &self,
        api: &Api<DynamicObject>,
        req: &StageRequest,
        name: &str,
        logs: &mpsc::Sender<LogLine>,
        cancel: CancellationToken,
    ) -> Result<Outcome, KubeError> {
        let say = Say(logs);
        let job_cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let mut jobs = watcher::watcher(api.clone(), job_cfg).default_backoff().boxed();
        let pods_api: Api<Pod> = Api::namespaced(self.client.clone(), self.namespace());
        let selector = format!("{POD_JOBSET_LABEL}={name},{POD_REPLICATED_JOB_LABEL}={NODE}");
        let mut pods = watcher::watcher(pods_api.clone(), watcher::Config::default().labels(&selector))
            .default_backoff()
            .boxed();
        let mut follower = LogFollower::new(pods_api.clone(), logs.clone());
        let mut seen_pods: BTreeMap<String, Pod> = BTreeMap::new();
        let mut last_state: Option<String> = None;
        let mut job_seen = false;

        loop {
            tokio::select! {
                _ = cancel.cancelled() => {
                    follower.abort();
                    match api.delete(name, &DeleteParams::background()).await {
                        Ok(_) => {}
                        Err(e) if api_status(&e).is_some_and(|s| s.is_not_found()) => {}
                        Err(e) => return Err(self.call_err(e, "delete", "trainjobs", name)),
                    }
                    say.line(format!("cancelled; deleted TrainJob {name}")).await;
                    return Ok(Outcome::Failed { class: FailureClass::Cancelled, message: format!("cancelled; TrainJob {name} deleted") });
                }
                event = jobs.next() => match event {
                    Some(Ok(Event::Apply(job) | Event::InitApply(job))) => {
                        job_seen = true;
                        match job_state(&to_value(&job)) {
                            JobState::Queued => {
                                if last_state.as_deref() != Some("queued") {
                                    last_state = Some("queued".into());
                                    say.line(format!("TrainJob {name} is queued (suspended, waiting for admission)")).await;
                                }
                            }
                            JobState::Active => {}
                            JobState::Complete => {
                                // Pods may have started and finished between two pod events.
                                refresh_pods(&pods_api, &selector, &mut seen_pods, &mut follower).await;
                                follower.drain(self.opts.log_drain).await;
                                say.line(format!("TrainJob {name} completed")).await;
                                return Ok(Outcome::Succeeded);
                            }
                            JobState::Failed { reason, message } => {
                                refresh_pods(&pods_api, &selector, &mut seen_pods, &mut follower).await;
                                follower.drain(self.opts.log_drain).await;
                                let pods: Vec<Pod> = seen_pods.into_values().collect();
                                let (class, why) = classify_failure(&reason, &message, &pods);
                                say.line(format!("TrainJob {name} failed ({class:?}): {why}")).await;
                                return Ok(Outcome::Failed { class, message: why });
                            }
                        }
                    }
                    Some(Ok(Event::Delete(_))) => {
                        follower.abort();
                        return Ok(Outcome::Failed { class: FailureClass::Infra, message: format!("TrainJob {name} was deleted while running") });
                    }
                    // A (re-)list that no longer contains the TrainJob: it was deleted meanwhile.
                    Some(Ok(Event::Init)) => job_seen = false,
                    Some(Ok(Event::InitDone)) if !job_seen => {
                        follower.abort();
                        return Ok(Outcome::Failed { class: FailureClass::Infra, message: format!("TrainJob {name} disappeared before it finished") });
                    }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => self.watch_error(e, "trainjobs", name)?,
                    None => return Err(KubeError::Api { verb: "watch".into(), resource: "trainjobs".into(), name: name.into(), message: "watch ended".into() }),
                },
                event = pods.next() => match event {
                    Some(Ok(Event::Apply(pod) | Event::InitApply(pod))) => {
                        follower.observe(&pod);
                        if let Some(why) = stuck_pod(&pod) {
                            follower.abort();
                            let _ = api.delete(name, &DeleteParams::background()).await;
                            say.line(format!("TrainJob {name} cannot start: {why}; deleted it")).await;
                            return Ok(Outcome::Failed { class: FailureClass::User, message: why });
                        }
                        if let Some(pod_name) = pod.metadata.name.clone() {
                            seen_pods.insert(pod_name, pod);
                        }
                        let running = seen_pods.values().filter(|p| phase(p) == "Running").count();
                        let state = match (running, seen_pods.values().find_map(unschedulable)) {
                            (0, Some(why)) => format!("pending: cannot be scheduled yet ({why})"),
                            (0, None) => "pending".into(),
                            _ => format!("running on {running}/{} nodes", req.num_nodes),
                        };
                        if last_state.as_deref() != Some(state.as_str()) {
                            say.line(format!("TrainJob {name} {state}")).await;
                            last_state = Some(state);
                        }
                    }
                    // Deleted pods stay in `seen_pods`: their status explains a failure.
                    Some(Ok(_)) => {}
                    Some(Err(e)) => self.watch_error(e, "pods", name)?,
                    None => {}
                },
            }
        }
    }

    /// Watch errors are retried by the watcher with backoff, except a permission refusal.
    fn watch_error(&self, err: watcher::Error, resource: &str, name: &str) -> Result<(), KubeError> {
        let status = match &err {
            watcher::Error::InitialListFailed(e) | watcher::Error::WatchStartFailed(e) => api_status(e).cloned(),
            watcher::Error::WatchError(s) => Some((**s).clone()),
            _ => None,
        };
        if let Some(s) = status.filter(|s| s.is_forbidden()) {
            return Err(KubeError::Forbidden {
                verb: "watch".into(),
                resource: resource.into(),
                namespace: self.namespace().into(),
                message: s.message,
            });
        }
        tracing::warn!(trainjob = name, "watch of {resource} interrupted, retrying: {err}");
        Ok(())
    }
}

/// Reads the pods once more at the end: their last status explains a failure, and a pod that
/// ran between two watch events still gets its logs streamed.
async fn refresh_pods(api: &Api<Pod>, selector: &str, seen: &mut BTreeMap<String, Pod>, follower: &mut LogFollower) {
    let Ok(list) = api.list(&ListParams::default().labels(selector)).await else { return };
    for pod in list.items {
        follower.observe(&pod);
        if let Some(name) = pod.metadata.name.clone() {
            seen.insert(name, pod);
        }
    }
}

/// The scheduler's reason for not placing a pod (missing GPUs, taints, ...).
fn unschedulable(pod: &Pod) -> Option<String> {
    let cond = pod.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == "PodScheduled")?;
    (cond.status == "False").then(|| cond.message.clone().or_else(|| cond.reason.clone()).unwrap_or_default())
}

fn phase(pod: &Pod) -> &str {
    pod.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("Pending")
}

fn to_value(obj: &DynamicObject) -> Value {
    serde_json::to_value(obj).unwrap_or(Value::Null)
}

/// Attach only to a TrainJob mflow created for exactly this stage, key and attempt.
fn check_ownership(obj: &DynamicObject, req: &StageRequest, name: &str) -> Result<(), KubeError> {
    let labels = obj.metadata.labels.clone().unwrap_or_default();
    let ann = obj.metadata.annotations.clone().unwrap_or_default();
    let foreign = |reason: String| KubeError::ForeignObject { kind: "TrainJob".into(), name: name.into(), reason };
    if labels.get(LABEL_MANAGED_BY).map(String::as_str) != Some(MANAGED_BY) {
        return Err(foreign(format!("it lacks the label {LABEL_MANAGED_BY}={MANAGED_BY}")));
    }
    let expect = [(ANN_PIPELINE, &req.pipeline), (ANN_STAGE, &req.stage), (ANN_KEY, &req.key)];
    for (key, want) in expect {
        if ann.get(key) != Some(want) {
            return Err(foreign(format!("its annotation {key} is {:?}, this stage has {want:?}", ann.get(key))));
        }
    }
    if labels.get(LABEL_ATTEMPT) != Some(&req.attempt.to_string()) {
        return Err(foreign(format!("it belongs to attempt {:?}", labels.get(LABEL_ATTEMPT))));
    }
    Ok(())
}
