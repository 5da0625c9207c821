//! Submitting a stage's TrainJob (or reattaching to it); `watch` follows it to the end.

use std::collections::BTreeMap;
use std::time::Duration;

use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backend::trainjob_resource;
use crate::classify::{job_state, JobState};
use crate::error::api_status;
use crate::expansion::unescape;
use crate::manifest::{
    trainjob_manifest, validate_request, ANN_KEY, ANN_PIPELINE, ANN_STAGE, LABEL_ATTEMPT, LABEL_MANAGED_BY, MANAGED_BY,
};
use crate::names::trainjob_name;
use crate::{KubeBackend, KubeError, LogLine, Outcome, StageRequest};

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
pub(crate) struct Say<'a>(pub(crate) &'a mpsc::Sender<LogLine>);

impl Say<'_> {
    pub(crate) async fn line(&self, text: String) {
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
            .filter_map(|v| Some((v.get("name")?.as_str()?.to_string(), unescape(v.get("value")?.as_str()?))))
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

    async fn create(
        &self,
        api: &Api<DynamicObject>,
        req: &StageRequest,
        name: &str,
        dry_run: bool,
    ) -> Result<(), KubeError> {
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
                Some(s) if s.is_invalid() || s.code == 400 || crate::error::is_admission_denial(s) => {
                    Err(KubeError::Invalid {
                        stage: req.stage.clone(),
                        kind: "TrainJob".into(),
                        name: name.into(),
                        message: s.message.clone(),
                    })
                }
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
}

pub(crate) fn to_value(obj: &DynamicObject) -> Value {
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
            Some(have) => {
                return Err(foreign(format!("its annotation {key} is \"{have}\", this stage's is \"{want}\"")))
            }
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
