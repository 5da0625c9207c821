//! Streaming the `node` container logs of every rank, across pod restarts and replacements.

use std::collections::HashSet;
use std::time::Duration;

use futures::{AsyncBufRead, AsyncBufReadExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, LogParams};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::classify::{node_container_started, pod_rank};
use crate::error::api_status;
use crate::manifest::NODE;
use crate::LogLine;

/// Longest log line passed on; the rest of a longer line is dropped, so a stage that prints
/// without newlines cannot exhaust mflow's memory.
pub(crate) const MAX_LINE: usize = 64 * 1024;

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
        let stream = format!("{uid}/{restarts}");
        if self.following.insert((uid, restarts)) {
            let rank = pod_rank(pod);
            self.tasks.spawn(follow(self.pods.clone(), name, rank, stream, self.tx.clone()));
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

async fn follow(pods: Api<Pod>, name: String, rank: Option<u32>, stream_id: String, tx: mpsc::Sender<LogLine>) {
    let params = LogParams { container: Some(NODE.to_string()), follow: true, ..Default::default() };
    // A container that has just started may still be reported as waiting; retry briefly.
    for attempt in 0..20u64 {
        match pods.log_stream(&name, &params).await {
            Ok(stream) => {
                let mut stream = std::pin::pin!(stream);
                while let Some(line) = next_line(&mut stream, MAX_LINE).await {
                    if tx.send(LogLine { rank, line, stream: Some(stream_id.clone()) }).await.is_err() {
                        return;
                    }
                }
                return;
            }
            Err(e) if api_status(&e).is_some_and(|s| s.code == 400) => {
                tokio::time::sleep(Duration::from_millis(100 * (attempt + 1).min(10))).await;
            }
            Err(e) => {
                let line = format!("mflow: cannot read the logs of pod {name}: {}", crate::error::describe(&e));
                let _ = tx.send(LogLine { rank: None, line, stream: None }).await;
                return;
            }
        }
    }
}

/// The next line of `reader` without its newline, cut to `max` bytes; `None` at the end or on a
/// read error.
pub(crate) async fn next_line<R: AsyncBufRead + Unpin>(reader: &mut R, max: usize) -> Option<String> {
    let mut line = Vec::new();
    let mut saw_any = false;
    loop {
        let buf = match reader.fill_buf().await {
            Ok(buf) => buf,
            Err(_) => return saw_any.then(|| finish(line)),
        };
        if buf.is_empty() {
            return saw_any.then(|| finish(line));
        }
        saw_any = true;
        let (chunk, used, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..i], i + 1, true),
            None => (buf, buf.len(), false),
        };
        let room = max.saturating_sub(line.len());
        line.extend_from_slice(&chunk[..chunk.len().min(room)]);
        reader.consume_unpin(used);
        if done {
            return Some(finish(line));
        }
    }
}

fn finish(mut line: Vec<u8>) -> String {
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    String::from_utf8_lossy(&line).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lines_are_split_and_bounded() {
        let text = format!("one\r\ntwo\n{}\nlast", "x".repeat(100));
        let mut reader = futures::io::Cursor::new(text.into_bytes());
        let mut lines = Vec::new();
        while let Some(line) = next_line(&mut reader, 10).await {
            lines.push(line);
        }
        assert_eq!(lines, ["one", "two", "xxxxxxxxxx", "last"]);
    }
}
