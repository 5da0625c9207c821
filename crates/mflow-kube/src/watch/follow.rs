//! One TrainJob followed to its end: what each event (the TrainJob's, its pods', a tick) means
//! for the stage, said in mflow's own lines, and the outcome once there is one.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::stream::BoxStream;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams};
use kube::runtime::watcher::{self, Event};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{humantime_secs, resume_point, Outage, COUNTS_EVERY, NO_POD_HINT, OUTAGE_PROBE, PENDING_POD_EVENTS};
use crate::classify::{classify_failure, job_state, stuck_pod, JobState};
use crate::error::api_status;
use crate::logs::LogFollower;
use crate::run::{to_value, Say};
use crate::state::{Coalesce, SeenPods, State};
use crate::{FailureClass, KubeBackend, KubeError, LogLine, Outcome, StageRequest};

type Events<K> = Option<Result<Event<K>, watcher::Error>>;
type PodEvents = BoxStream<'static, Result<Event<Pod>, watcher::Error>>;

/// What is known of the TrainJob `name` while it is followed.
pub(super) struct Follow<'a> {
    backend: &'a KubeBackend,
    api: &'a Api<DynamicObject>,
    req: &'a StageRequest,
    name: &'a str,
    say: Say<'a>,
    pods_api: Api<Pod>,
    selector: String,
    follower: LogFollower,
    seen: SeenPods,
    pub(super) shown: Coalesce,
    job_seen: bool,
    suspended: bool,
    pub(super) outage: Outage,
    pub(super) start: StartWatch,
}

impl<'a> Follow<'a> {
    pub(super) fn new(
        backend: &'a KubeBackend,
        api: &'a Api<DynamicObject>,
        req: &'a StageRequest,
        name: &'a str,
        logs: &'a mpsc::Sender<LogLine>,
        pods_api: Api<Pod>,
        selector: String,
    ) -> Self {
        Follow {
            backend,
            api,
            req,
            name,
            say: Say(logs),
            follower: LogFollower::new(pods_api.clone(), logs.clone()),
            pods_api,
            selector,
            seen: SeenPods::default(),
            shown: Coalesce::new(COUNTS_EVERY),
            job_seen: false,
            suspended: false,
            outage: Outage::new(&backend.target.url),
            start: StartWatch::new(backend.opts.start_timeout),
        }
    }

    async fn line(&self, text: String) {
        self.say.line(text).await;
    }

    /// Says the pods' state when it changed (never while the TrainJob is suspended).
    async fn offer_state(&mut self) {
        if self.suspended {
            return;
        }
        let state = self.seen.state(self.req.num_nodes, self.start.started, Timestamp::now());
        if let Some(line) = self.shown.offer(state) {
            self.line(format!("TrainJob {} {line}", self.name)).await;
        }
    }

    pub(super) async fn cancelled(&mut self) -> Result<Outcome, KubeError> {
        let name = self.name;
        self.follower.abort();
        match self.api.delete(name, &DeleteParams::background()).await {
            Ok(_) => {}
            Err(e) if api_status(&e).is_some_and(|s| s.is_not_found()) => {}
            Err(e) => return Err(self.backend.call_err(e, "delete", "trainjobs", name)),
        }
        self.line(format!("cancelled; deleted TrainJob {name}")).await;
        Ok(Outcome::Failed { class: FailureClass::Cancelled, message: format!("TrainJob {name} deleted") })
    }

    pub(super) async fn detached(&mut self) -> Outcome {
        self.follower.abort();
        let message =
            format!("interrupted; TrainJob {} left running (the next `mflow run` reattaches to it)", self.name);
        self.line(message.clone()).await;
        Outcome::Detached { message }
    }

    /// Asks the API server that went away whether it is back.
    pub(super) async fn probe(&mut self) {
        let back = tokio::time::timeout(OUTAGE_PROBE, self.backend.client.apiserver_version()).await;
        if matches!(back, Ok(Ok(_))) {
            self.server_answered().await;
        }
    }

    async fn server_answered(&mut self) {
        if let Some(line) = self.outage.answered() {
            self.line(line).await;
        }
    }

    pub(super) async fn say_due(&mut self) {
        if let Some(line) = self.shown.due() {
            self.line(format!("TrainJob {} {line}", self.name)).await;
        }
    }

    /// While no pod has started: the cluster's warnings, a hint where to look, and the end of
    /// the wait at the start timeout.
    pub(super) async fn starting(&mut self) -> Option<Outcome> {
        let name = self.name;
        for warning in self.backend.new_warnings(name, &mut self.start.warned).await {
            self.line(format!("TrainJob {name} is not starting: {warning}")).await;
            self.start.last_warning = Some(warning);
        }
        let hint_after = NO_POD_HINT.min(self.start.timeout / 2);
        // A Warning already said why; the controllers are not the question then.
        let start = &self.start;
        if self.seen.is_empty() && !start.hinted && start.last_warning.is_none() && start.waited() >= hint_after {
            self.start.hinted = true;
            self.line(format!(
                "TrainJob {name} has no pods after {}: check that the Kubeflow Trainer and JobSet controllers run (kubectl get pods -n kubeflow-system) and `kubectl describe trainjob {name} -n {}`",
                humantime_secs(hint_after),
                self.backend.namespace()
            ))
            .await;
        }
        if self.start.waited() < self.start.timeout {
            return None;
        }
        self.follower.abort();
        let _ = self.api.delete(name, &DeleteParams::background()).await;
        let why = self
            .start
            .last_warning
            .clone()
            .or_else(|| self.shown.latest().map(str::to_string))
            .unwrap_or_else(|| "no pod was created: is the Trainer controller running?".into());
        let message = format!(
            "TrainJob {name} did not start within {} ({why}); deleted it (raise [pipeline.kubernetes] start_timeout if the cluster is only slow)",
            humantime_secs(self.start.timeout)
        );
        self.line(message.clone()).await;
        Some(Outcome::Failed { class: FailureClass::Infra, message })
    }

    pub(super) async fn job_event(
        &mut self,
        event: Events<DynamicObject>,
        pods: &mut PodEvents,
    ) -> Result<Option<Outcome>, KubeError> {
        let name = self.name;
        if let Some(Ok(_)) = &event {
            self.server_answered().await;
        }
        match event {
            Some(Ok(Event::Apply(job) | Event::InitApply(job))) => {
                self.job_seen = true;
                return Ok(self.job_changed(job_state(&to_value(&job)), pods).await);
            }
            Some(Ok(Event::Delete(_))) => {
                self.follower.abort();
                let message = format!("TrainJob {name} was deleted while running");
                return Ok(Some(Outcome::Failed { class: FailureClass::Infra, message }));
            }
            // A (re-)list that no longer contains the TrainJob: it was deleted meanwhile.
            Some(Ok(Event::Init)) => self.job_seen = false,
            Some(Ok(Event::InitDone)) if !self.job_seen => {
                self.follower.abort();
                let message = format!("TrainJob {name} disappeared before it finished");
                return Ok(Some(Outcome::Failed { class: FailureClass::Infra, message }));
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                if let Some(line) = self.backend.watch_error(e, "trainjobs", &mut self.outage)? {
                    self.line(line).await;
                }
            }
            None => {
                return Err(KubeError::Api {
                    verb: "watch".into(),
                    resource: "trainjobs".into(),
                    name: name.into(),
                    message: "watch ended".into(),
                })
            }
        }
        Ok(None)
    }

    async fn job_changed(&mut self, state: JobState, pods: &mut PodEvents) -> Option<Outcome> {
        let name = self.name;
        self.start.queue(state == JobState::Queued);
        match state {
            JobState::Queued if self.start.started => {
                if !self.suspended {
                    self.suspended = true;
                    self.line(format!("TrainJob {name} is suspended (spec.suspend, set by an admin or a queue such as Kueue): its pods are stopped until it is resumed")).await;
                }
                None
            }
            JobState::Queued => {
                let text = "is queued (suspended, waiting for admission)".to_string();
                if let Some(line) = self.shown.offer(State { key: "queued".into(), text }) {
                    self.line(format!("TrainJob {name} {line}")).await;
                }
                None
            }
            JobState::Active => {
                if std::mem::take(&mut self.suspended) {
                    let point = resume_point(self.req);
                    self.line(format!("TrainJob {name} was resumed: new pods run the stage again, {point}")).await;
                }
                None
            }
            JobState::Complete => {
                self.last_state(pods).await;
                self.line(format!("TrainJob {name} completed")).await;
                Some(Outcome::Succeeded)
            }
            JobState::Failed { reason, message } => {
                self.last_state(pods).await;
                let (class, why) =
                    classify_failure(&reason, &message, &std::mem::take(&mut self.seen).in_order_of_ends());
                // The class is the engine's to say: a stage may refine it.
                self.line(format!("TrainJob {name} failed: {why}")).await;
                Some(Outcome::Failed { class, message: why })
            }
        }
    }

    /// At the end: the pods read once more, their logs drained, and their last state said if it
    /// was not yet.
    async fn last_state(&mut self, pods: &mut PodEvents) {
        // Pods may have started and finished between two pod events.
        refresh_pods(&self.pods_api, &self.selector, pods, &mut self.seen, &mut self.follower).await;
        self.follower.drain(self.backend.opts.log_drain).await;
        let state = self.seen.state(self.req.num_nodes, self.start.started, Timestamp::now());
        if let Some(line) = self.shown.offer(state).or_else(|| self.shown.due()) {
            self.line(format!("TrainJob {} {line}", self.name)).await;
        }
    }

    pub(super) async fn pod_event(&mut self, event: Events<Pod>) -> Result<Option<Outcome>, KubeError> {
        if let Some(Ok(_)) = &event {
            self.server_answered().await;
        }
        match event {
            Some(Ok(Event::Apply(pod) | Event::InitApply(pod))) => {
                self.follower.observe(&pod);
                if let Some(why) = stuck_pod(&pod) {
                    self.follower.abort();
                    let _ = self.api.delete(self.name, &DeleteParams::background()).await;
                    self.line(format!("TrainJob {} cannot start: {why}; deleted it", self.name)).await;
                    return Ok(Some(Outcome::Failed { class: FailureClass::User, message: why }));
                }
                self.seen.observe(pod, false);
                self.start.started |= self.seen.any_started();
                self.offer_state().await;
            }
            // Deleted pods are kept: their status explains a failure.
            Some(Ok(Event::Delete(pod))) => {
                self.seen.observe(pod, true);
                self.offer_state().await;
            }
            Some(Ok(_)) | None => {}
            Some(Err(e)) => {
                if let Some(line) = self.backend.watch_error(e, "pods", &mut self.outage)? {
                    self.line(line).await;
                }
            }
        }
        Ok(None)
    }
}

/// Reads the pods once more at the end: their last status explains a failure, and a pod that
/// ran between two watch events still gets its logs read. The TrainJob's condition and its
/// pods' changes come on two streams, so the pod events already on their way (a deleted pod's
/// last status, which a list no longer shows) are taken first.
async fn refresh_pods<S>(
    api: &Api<Pod>,
    selector: &str,
    events: &mut S,
    seen: &mut SeenPods,
    follower: &mut LogFollower,
) where
    S: futures::Stream<Item = Result<Event<Pod>, watcher::Error>> + Unpin,
{
    while let Ok(Some(event)) = tokio::time::timeout(PENDING_POD_EVENTS, events.next()).await {
        match event {
            Ok(Event::Apply(pod) | Event::InitApply(pod)) => {
                follower.observe(&pod);
                seen.observe(pod, false);
            }
            Ok(Event::Delete(pod)) => seen.observe(pod, true),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    let Ok(list) = api.list(&ListParams::default().labels(selector)).await else { return };
    for pod in list.items {
        follower.observe(&pod);
        seen.observe(pod, false);
    }
}

/// Whether a TrainJob has started, and how long it has waited (time queued by Kueue does not
/// count).
pub(super) struct StartWatch {
    pub(super) started: bool,
    pub(super) queued: bool,
    timeout: Duration,
    waited_before: Duration,
    since: Instant,
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
            since: Instant::now(),
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
            (true, false) => self.since = Instant::now(),
            _ => {}
        }
        self.queued = queued;
    }
}
