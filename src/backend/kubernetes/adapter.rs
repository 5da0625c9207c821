//! The in-process adapter: one attempt of a stage as one TrainJob, submitted or reattached to,
//! followed to its end with its pods' lines in the attempt log and the display.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use mflow_kube::{JobState, LogLine, StageRequest};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::shown::ShownLines;
use super::{workload_files, Kubernetes, KubernetesError};
use crate::backend::{AttemptArea, Cancel, Job, Line, Lines, Outcome};
use crate::stages::Kind;
use mflow_contract::FailureClass;

impl Kubernetes {
    pub async fn run(self: &Arc<Self>, job: &Job, lines: Lines, cancel: watch::Receiver<Cancel>) -> Outcome {
        if let Some(dir) = job.log.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let log = match std::fs::File::create(&job.log) {
            Ok(f) => f,
            Err(e) => {
                return Outcome::Failed {
                    class: FailureClass::Infra,
                    message: format!("cannot create log {}: {e}", job.log.display()),
                }
            }
        };
        match self.attempt(job, log, lines, cancel).await {
            Ok(outcome) => outcome,
            Err(e) => Outcome::Failed { class: e.class(), message: e.explain() },
        }
    }

    async fn attempt(
        &self,
        job: &Job,
        log: std::fs::File,
        lines: Lines,
        cancel: watch::Receiver<Cancel>,
    ) -> Result<Outcome, KubernetesError> {
        let info = self
            .layout
            .stages
            .get(&job.stage)
            .ok_or_else(|| KubernetesError::UnknownStage { stage: job.stage.clone() })?;
        let digest = if info.kind.uses_python() { Some(self.ensure_workloads().await?) } else { None };
        // The job names the TrainJob's own directory already (`attempt_area`).
        let own = job.area.reattachable.then_some(&job.area);
        let req = self.layout.request(job, info, digest)?;
        let status = self.prepare(&req, info.kind, own).await?.unwrap_or_else(|| job.status_file.clone());

        // Pod lines go to the attempt log and the display, as local output does. A reattached
        // TrainJob's containers are followed from their first line again: the attempt log gets
        // every line, the display only those an earlier mflow process did not show.
        let (tx, mut rx) = mpsc::channel::<LogLine>(1024);
        let (stage, attempt) = (job.stage.clone(), job.attempt);
        let mut shown = own.map(|o| ShownLines::load(&o.dir));
        let pump = tokio::spawn(async move {
            let mut log = std::io::BufWriter::new(log);
            while let Some(line) = rx.recv().await {
                let text = line.to_string();
                let _ = writeln!(log, "{text}");
                let _ = log.flush();
                if shown.as_mut().is_none_or(|s| s.first_time(line.stream.as_deref())) {
                    lines.send(Line { stage: stage.clone(), attempt, text }).await;
                }
            }
            if let Some(s) = shown.as_mut() {
                s.save();
            }
        });
        let (cancel_token, detach_token) = (CancellationToken::new(), CancellationToken::new());
        let bridge = {
            let (cancel_token, detach_token, mut cancel) = (cancel_token.clone(), detach_token.clone(), cancel);
            tokio::spawn(async move {
                // The first word counts: once interrupted, the TrainJob is left running.
                match cancel.wait_for(|c| *c != Cancel::None).await.map(|c| *c) {
                    Ok(Cancel::Detach) => detach_token.cancel(),
                    Ok(_) => cancel_token.cancel(),
                    Err(_) => {}
                }
            })
        };
        let result = self.kube.run_until(&req, tx, cancel_token, detach_token).await;
        bridge.abort();
        let _ = pump.await;
        let outcome = match result? {
            mflow_kube::Outcome::Detached { message } => Outcome::Detached { message },
            mflow_kube::Outcome::Succeeded => match own.filter(|o| !o.out.is_dir()) {
                Some(o) => Outcome::Failed {
                    class: FailureClass::Infra,
                    message: format!(
                        "the TrainJob completed, but its output {} is missing from the artifact volume",
                        o.out.display()
                    ),
                },
                None => Outcome::Success,
            },
            // The engine keeps the stage's reports from the area, then clears it.
            mflow_kube::Outcome::Failed { class, message } => {
                // The stage's own word (written on the shared volume) refines the pod's exit.
                match crate::backend::local::read_status(&status) {
                    Some((own, why)) if matches!(class, FailureClass::User | FailureClass::Infra) => {
                        Outcome::Failed { class: own, message: why }
                    }
                    _ => Outcome::Failed { class, message },
                }
            }
        };
        Ok(outcome)
    }

    /// Gets the TrainJob's own directory (its attempt's area) ready and returns the status file
    /// of an own TrainJob left by an earlier mflow process (it writes where that process told
    /// it to). A fresh submission starts from an empty directory; a reattached TrainJob keeps
    /// what it wrote; a completed one whose output is gone is deleted, so that it runs again.
    async fn prepare(
        &self,
        req: &StageRequest,
        kind: Kind,
        own: Option<&AttemptArea>,
    ) -> Result<Option<PathBuf>, KubernetesError> {
        let existing = self.kube.existing(req).await?;
        let status = existing.as_ref().and_then(|e| e.env.get("MFLOW_STATUS")).map(PathBuf::from);
        let Some(own) = own else { return Ok(status) };
        let fresh = match existing.as_ref().map(|e| &e.state) {
            None | Some(JobState::Failed { .. }) => true,
            Some(JobState::Complete) if !own.out.is_dir() => {
                self.kube.forget(req).await?;
                true
            }
            Some(_) => false,
        };
        if fresh {
            clear(own);
        }
        // Native commands create `out` themselves (atomically, next to it); the others write
        // into it.
        let dir = if native(kind) { own.dir.clone() } else { own.out.clone() };
        std::fs::create_dir_all(&dir)
            .map_err(|e| KubernetesError::Volume { path: dir.display().to_string(), message: e.to_string() })?;
        Ok(if fresh { None } else { status })
    }

    async fn ensure_workloads(&self) -> Result<String, KubernetesError> {
        let digest = self
            .workloads
            .get_or_try_init(|| async {
                let digest = crate::env::workloads_digest();
                self.kube.ensure_workloads(&digest, &workload_files()).await?;
                Ok::<_, KubernetesError>(digest)
            })
            .await?;
        Ok(digest.clone())
    }
}

fn native(kind: Kind) -> bool {
    !matches!(kind, Kind::Command | Kind::Train | Kind::Evaluate)
}

/// Removes what a failed or superseded TrainJob left in its area.
fn clear(area: &AttemptArea) {
    let _ = std::fs::remove_dir_all(&area.dir);
}
