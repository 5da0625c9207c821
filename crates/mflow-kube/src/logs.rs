//! Streaming the `node` container logs of every rank, across pod restarts and replacements.

use std::collections::HashSet;
use std::time::Duration;

use futures::{AsyncBufReadExt, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, LogParams};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::classify::{node_container_started, pod_rank};
use crate::error::api_status;
use crate::manifest::NODE;
use crate::LogLine;

/// Starts one log stream per started container instance (pod uid + restart count).
pub(crate) struct LogFollower {
    pods: Api<Pod>,
    tx: mpsc::Sender<LogLine>,
    following: HashSet<(String, i32)>,
    tasks: JoinSet<()>,
}

impl LogFollower {
    pub(crate) fn new(pods: Api<Pod>, tx: mpsc::Sender<LogLine>) -> Self {
        LogFollower { pods, tx, following: HashSet::new(), tasks: JoinSet::new() }
    }

    /// Called for every pod event; pending pods are picked up once their container starts.
    pub(crate) fn observe(&mut self, pod: &Pod) {
        let Some(restarts) = node_container_started(pod) else { return };
        let Some(name) = pod.metadata.name.clone() else { return };
        let uid = pod.metadata.uid.clone().unwrap_or_else(|| name.clone());
        if self.following.insert((uid, restarts)) {
            let rank = pod_rank(pod);
            self.tasks.spawn(follow(self.pods.clone(), name, rank, self.tx.clone()));
        }
    }

    /// Waits up to `limit` for the streams to reach the end of their containers' output.
    pub(crate) async fn drain(&mut self, limit: Duration) {
        let all_done = async { while self.tasks.join_next().await.is_some() {} };
        if tokio::time::timeout(limit, all_done).await.is_err() {
            tracing::debug!("log streams still open after {limit:?}; closing them");
        }
        self.tasks.abort_all();
    }

    pub(crate) fn abort(&mut self) {
        self.tasks.abort_all();
    }
}

async fn follow(pods: Api<Pod>, name: String, rank: Option<u32>, tx: mpsc::Sender<LogLine>) {
    let params = LogParams { container: Some(NODE.to_string()), follow: true, ..Default::default() };
    // A container that has just started may still be reported as waiting; retry briefly.
    for attempt in 0..20u64 {
        match pods.log_stream(&name, &params).await {
            Ok(stream) => {
                let mut lines = stream.lines();
                while let Some(Ok(line)) = lines.next().await {
                    if tx.send(LogLine { rank, line }).await.is_err() {
                        return;
                    }
                }
                return;
            }
            Err(e) if api_status(&e).is_some_and(|s| s.code == 400) => {
                tokio::time::sleep(Duration::from_millis(100 * (attempt + 1).min(10))).await;
            }
            Err(e) => {
                let line = format!("mflow: cannot read the logs of pod {name}: {e}");
                let _ = tx.send(LogLine { rank: None, line }).await;
                return;
            }
        }
    }
}
