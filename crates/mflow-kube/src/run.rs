//! Submitting a stage's TrainJob (or reattaching to it) and watching it to the end.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Pod};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backend::trainjob_resource;
use crate::classify::{classify_failure, job_state, node_container_started, stuck_pod, JobState};
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
        let _ = self.0.send(LogLine { rank: None, line: format!("mflow: {text}"), stream: None }).await;
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
        self.run_until(req, logs, cancel, CancellationToken::new()).await
    }

    /// [`KubeBackend::run`], and `detach` stops following without touching the TrainJob: it
    /// keeps running, and a later `run` of the same attempt reattaches to it
    /// ([`Outcome::Detached`]).
    pub async fn run_until(
        &self,
        req: &StageRequest,
        logs: mpsc::Sender<LogLine>,
        cancel: CancellationToken,
        detach: CancellationToken,
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
        self.watch(&api, req, &name, &logs, cancel, detach).await
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
                // An admission webhook's refusal comes as 403 or 422: the object, not the
                // caller's rights, is at fault.
                Some(s) if s.is_invalid() || s.code == 400 || crate::error::is_admission_denial(s) => Err(KubeError::Invalid {
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
        detach: CancellationToken,
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
        let mut start = StartWatch::new(self.opts.start_timeout);
        let mut poll = tokio::time::interval(self.opts.event_poll);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

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
                    return Ok(Outcome::Failed { class: FailureClass::Cancelled, message: format!("TrainJob {name} deleted") });
                }
                _ = detach.cancelled() => {
                    follower.abort();
                    let message = format!("interrupted; TrainJob {name} left running (the next `mflow run` reattaches to it)");
                    say.line(message.clone()).await;
                    return Ok(Outcome::Detached { message });
                }
                _ = poll.tick(), if !start.started && !start.queued => {
                    for warning in self.new_warnings(name, &mut start.warned).await {
                        say.line(format!("TrainJob {name} is not starting: {warning}")).await;
                        start.last_warning = Some(warning);
                    }
                    let hint_after = NO_POD_HINT.min(start.timeout / 2);
                    if seen_pods.is_empty() && !start.hinted && start.waited() >= hint_after {
                        start.hinted = true;
                        say.line(format!(
                            "TrainJob {name} has no pods after {}: check that the Kubeflow Trainer and JobSet controllers run (kubectl get pods -n kubeflow-system) and `kubectl describe trainjob {name} -n {}`",
                            humantime_secs(hint_after), self.namespace()
                        )).await;
                    }
                    if start.waited() >= start.timeout {
                        follower.abort();
                        let _ = api.delete(name, &DeleteParams::background()).await;
                        let why = start.last_warning.clone()
                            .or_else(|| last_state.clone())
                            .unwrap_or_else(|| "no pod was created: is the Trainer controller running?".into());
                        let message = format!(
                            "TrainJob {name} did not start within {} ({why}); deleted it (raise [pipeline.kubernetes] start_timeout if the cluster is only slow)",
                            humantime_secs(start.timeout)
                        );
                        say.line(message.clone()).await;
                        return Ok(Outcome::Failed { class: FailureClass::Infra, message });
                    }
                }
                event = jobs.next() => match event {
                    Some(Ok(Event::Apply(job) | Event::InitApply(job))) => {
                        job_seen = true;
                        let state = job_state(&to_value(&job));
                        start.queue(state == JobState::Queued);
                        match state {
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
                                // The class is the engine's to say: a stage may refine it.
                                say.line(format!("TrainJob {name} failed: {why}")).await;
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
                        start.started |= seen_pods.values().any(pod_started);
                        let state = pods_state(&seen_pods, req.num_nodes, start.started);
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

    /// Warning events of the TrainJob and of the objects named after it (its JobSet, Jobs and
    /// pods) not reported yet, as `pod X: Reason: message`. Events are advice: when they cannot
    /// be read, there are none.
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
            let text = format!("{kind} {object}: {reason}: {}", excerpt(e.message.as_deref().unwrap_or_default(), 300));
            if warned.insert(text.clone()) {
                out.push(text);
            }
        }
        out
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
                namespace: Some(self.namespace().into()),
                rbac_namespace: self.namespace().into(),
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

/// After this long without a pod, mflow says where to look.
const NO_POD_HINT: Duration = Duration::from_secs(30);

/// Whether a TrainJob has started, and how long it has waited (time queued by Kueue does not
/// count).
struct StartWatch {
    started: bool,
    queued: bool,
    timeout: Duration,
    waited_before: Duration,
    since: tokio::time::Instant,
    hinted: bool,
    warned: BTreeSet<String>,
    last_warning: Option<String>,
}

impl StartWatch {
    fn new(timeout: Duration) -> Self {
        StartWatch {
            started: false,
            queued: false,
            timeout,
            waited_before: Duration::ZERO,
            since: tokio::time::Instant::now(),
            hinted: false,
            warned: BTreeSet::new(),
            last_warning: None,
        }
    }

    fn waited(&self) -> Duration {
        if self.queued {
            self.waited_before
        } else {
            self.waited_before + self.since.elapsed()
        }
    }

    fn queue(&mut self, queued: bool) {
        match (self.queued, queued) {
            (false, true) => self.waited_before += self.since.elapsed(),
            (true, false) => self.since = tokio::time::Instant::now(),
            _ => {}
        }
        self.queued = queued;
    }
}

/// A pod whose container has started, or that has run to its end.
fn pod_started(pod: &Pod) -> bool {
    node_container_started(pod).is_some() || matches!(phase(pod), "Running" | "Succeeded" | "Failed")
}

/// The state line of a TrainJob from its pods. Once a pod has started, the state never falls
/// back to `pending`: pods that finished wait for the TrainJob's condition.
fn pods_state(pods: &BTreeMap<String, Pod>, nodes: u32, started: bool) -> String {
    let running = pods.values().filter(|p| phase(p) == "Running").count();
    let finished = pods.values().filter(|p| matches!(phase(p), "Succeeded" | "Failed")).count();
    if running > 0 {
        return format!("running on {running}/{nodes} nodes");
    }
    if finished > 0 {
        return format!("pods finished on {finished}/{nodes} nodes; waiting for the TrainJob's status");
    }
    if started {
        return "starting".into();
    }
    if let Some(why) = pods.values().find_map(unschedulable) {
        return format!("pending: cannot be scheduled yet ({why})");
    }
    match pods.values().find_map(waiting_reason) {
        Some(why) => format!("pending: {why}"),
        None => "pending".into(),
    }
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

/// At most `max` characters of a message from the cluster, on one line.
pub(crate) fn excerpt(text: &str, max: usize) -> String {
    let one_line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match one_line.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &one_line[..cut]),
        None => one_line,
    }
}

fn humantime_secs(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 60, s % 60) {
        (0, s) => format!("{s}s"),
        (m, 0) => format!("{m}m"),
        (m, s) => format!("{m}m{s}s"),
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
        match ann.get(key) {
            Some(have) if have == want => {}
            Some(have) => return Err(foreign(format!("its annotation {key} is \"{have}\", this stage's is \"{want}\""))),
            None => return Err(foreign(format!("it has no annotation {key}"))),
        }
    }
    match labels.get(LABEL_ATTEMPT) {
        Some(a) if *a == req.attempt.to_string() => {}
        Some(a) => return Err(foreign(format!("it belongs to attempt {a}, not {}", req.attempt))),
        None => return Err(foreign(format!("it has no label {LABEL_ATTEMPT}"))),
    }
    Ok(())
}
