//! Reading the `node` container logs: rank 0 followed to the end across broken streams and
//! in-place restarts, and the whole log of any other rank whose container failed on its own.

use std::collections::HashSet;
use std::time::Duration;

use futures::{AsyncBufRead, AsyncBufReadExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, LogParams};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::classify::{node_container_started, pod_rank, SIGNAL_EXIT_CODES};
use crate::error::api_status;
use crate::manifest::NODE;
use crate::LogLine;

/// Longest log line passed on; the rest of a longer line is dropped, so a stage that prints
/// without newlines cannot exhaust mflow's memory.
pub(crate) const MAX_LINE: usize = 64 * 1024;
/// Whole logs of failed ranks read per attempt; past this, mflow names the pods instead.
const MAX_FAILED_LOGS: usize = 4;
/// The most read of one failed rank's log.
const FAILED_LOG_BYTES: i64 = 16 << 20;

/// Follows rank 0's container instances (pod uid + restart count), one stream each, and reads
/// the log of another rank's failed instance once.
pub(crate) struct LogFollower {
    pods: Api<Pod>,
    tx: mpsc::Sender<LogLine>,
    following: HashSet<(String, i32)>,
    failed: HashSet<(String, i32)>,
    tasks: JoinSet<()>,
}

impl LogFollower {
    pub(crate) fn new(pods: Api<Pod>, tx: mpsc::Sender<LogLine>) -> Self {
        LogFollower { pods, tx, following: HashSet::new(), failed: HashSet::new(), tasks: JoinSet::new() }
    }

    /// Called for every pod event; pending pods are picked up once their container starts.
    pub(crate) fn observe(&mut self, pod: &Pod) {
        let Some(name) = pod.metadata.name.clone() else { return };
        let uid = pod.metadata.uid.clone().unwrap_or_else(|| name.clone());
        let rank = pod_rank(pod);
        if rank.unwrap_or(0) == 0 {
            let Some(restarts) = node_container_started(pod) else { return };
            if self.following.insert((uid.clone(), restarts)) {
                let instance = Instance { pods: self.pods.clone(), name, uid, restarts, rank };
                self.tasks.spawn(follow(instance, self.tx.clone()));
            }
            return;
        }
        for (restarts, previous) in failed_instances(pod) {
            if !self.failed.insert((uid.clone(), restarts)) {
                continue;
            }
            let instance = Instance { pods: self.pods.clone(), name: name.clone(), uid: uid.clone(), restarts, rank };
            if self.failed.len() <= MAX_FAILED_LOGS {
                self.tasks.spawn(read_failed(instance, previous, self.tx.clone()));
            } else {
                let tx = self.tx.clone();
                let ns = self.pods.namespace().unwrap_or("default").to_string();
                let line = format!(
                    "mflow: rank {} failed too; its log: kubectl logs -n {ns} {name} -c {NODE}{}",
                    rank.unwrap_or(0),
                    if previous { " --previous" } else { "" }
                );
                self.tasks.spawn(async move {
                    let _ = tx.send(LogLine { rank: None, line, stream: None }).await;
                });
            }
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

/// Container instances of a pod that ended with a failure of their own (not a signal from a
/// deletion or a teardown, an OOM kill aside): (restart count, whether it is the previous one).
fn failed_instances(pod: &Pod) -> Vec<(i32, bool)> {
    let Some(cs) =
        pod.status.as_ref().and_then(|s| s.container_statuses.as_ref()).and_then(|c| c.iter().find(|c| c.name == NODE))
    else {
        return Vec::new();
    };
    let own = |t: &k8s_openapi::api::core::v1::ContainerStateTerminated| {
        t.exit_code != 0 && (!SIGNAL_EXIT_CODES.contains(&t.exit_code) || t.reason.as_deref() == Some("OOMKilled"))
    };
    let mut out = Vec::new();
    if cs.last_state.as_ref().and_then(|s| s.terminated.as_ref()).is_some_and(own) && cs.restart_count > 0 {
        out.push((cs.restart_count - 1, true));
    }
    if cs.state.as_ref().and_then(|s| s.terminated.as_ref()).is_some_and(own) {
        out.push((cs.restart_count, false));
    }
    out
}

/// One container instance of a pod.
struct Instance {
    pods: Api<Pod>,
    name: String,
    uid: String,
    restarts: i32,
    rank: Option<u32>,
}

/// What became of a followed container instance.
enum Fate {
    Running,
    Ended,
    /// Restarted in place: its log is now the pod's `previous` one.
    Restarted,
    Gone,
    /// The API server did not answer.
    Unknown,
}

impl Instance {
    fn stream_id(&self) -> String {
        format!("{}/{}", self.uid, self.restarts)
    }

    async fn fate(&self) -> Fate {
        let pod = match self.pods.get_opt(&self.name).await {
            Ok(Some(pod)) if pod.metadata.uid.as_deref().unwrap_or(&self.name) == self.uid => pod,
            Ok(_) => return Fate::Gone,
            Err(_) => return Fate::Unknown,
        };
        let status = pod.status.as_ref();
        let Some(cs) =
            status.and_then(|s| s.container_statuses.as_ref()).and_then(|c| c.iter().find(|c| c.name == NODE))
        else {
            return Fate::Gone;
        };
        if cs.restart_count == self.restarts + 1 {
            return Fate::Restarted;
        }
        if cs.restart_count > self.restarts {
            return Fate::Gone;
        }
        let running = cs.state.as_ref().is_some_and(|s| s.running.is_some());
        let done = matches!(status.and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed"));
        if running && !done {
            Fate::Running
        } else {
            Fate::Ended
        }
    }
}

/// Follows one container instance to its end. A stream that ends or breaks while the container
/// runs (an API server restart, a kubelet that dropped it) is opened again from the time of its
/// last line, and the lines already passed on are skipped; once the container has ended its
/// log is read once more from there, so that nothing it printed is missing.
async fn follow(instance: Instance, tx: mpsc::Sender<LogLine>) {
    let stream = instance.stream_id();
    let mut cursor = Cursor::default();
    let mut last_read: Option<bool> = None;
    let mut waiting = 0u64;
    let mut backoff = Backoff::default();
    loop {
        let params = LogParams {
            container: Some(NODE.to_string()),
            follow: last_read.is_none(),
            previous: last_read == Some(true),
            timestamps: true,
            since_time: cursor.since(),
            ..Default::default()
        };
        cursor.reopen();
        tracing::debug!(pod = %instance.name, follow = params.follow, "opening a log stream");
        match instance.pods.log_stream(&instance.name, &params).await {
            Ok(body) => {
                backoff.reset();
                let mut body = std::pin::pin!(body);
                while let Some(raw) = next_line(&mut body, MAX_LINE + 64).await {
                    let Some(line) = cursor.fresh(&raw) else { continue };
                    if tx.send(LogLine { rank: instance.rank, line, stream: Some(stream.clone()) }).await.is_err() {
                        return;
                    }
                }
                if last_read.is_some() {
                    return;
                }
            }
            // A container that has just started may still be reported as waiting.
            Err(e) if api_status(&e).is_some_and(|s| s.code == 400) && last_read.is_none() && waiting < 20 => {
                waiting += 1;
                tokio::time::sleep(Duration::from_millis(100 * waiting.min(10))).await;
                continue;
            }
            Err(e) if api_status(&e).is_some_and(|s| s.code == 404 || s.code == 400) => return,
            Err(e) if api_status(&e).is_some_and(|s| s.code == 401 || s.code == 403) => {
                let line =
                    format!("mflow: cannot read the logs of pod {}: {}", instance.name, crate::error::describe(&e));
                let _ = tx.send(LogLine { rank: None, line, stream: None }).await;
                return;
            }
            Err(e) => {
                tracing::debug!(pod = %instance.name, "cannot open the log stream, trying again: {}", crate::error::describe(&e));
                backoff.wait().await;
            }
        }
        last_read = match instance.fate().await {
            Fate::Running => None,
            Fate::Ended => Some(false),
            Fate::Restarted => Some(true),
            Fate::Gone => return,
            Fate::Unknown => {
                backoff.wait().await;
                None
            }
        };
    }
}

/// Reads the whole log of a failed container instance once.
async fn read_failed(instance: Instance, previous: bool, tx: mpsc::Sender<LogLine>) {
    let params = LogParams {
        container: Some(NODE.to_string()),
        previous,
        limit_bytes: Some(FAILED_LOG_BYTES),
        ..Default::default()
    };
    let stream = Some(instance.stream_id());
    let mut backoff = Backoff::default();
    for _ in 0..5 {
        match instance.pods.log_stream(&instance.name, &params).await {
            Ok(body) => {
                let mut body = std::pin::pin!(body);
                while let Some(line) = next_line(&mut body, MAX_LINE).await {
                    if tx.send(LogLine { rank: instance.rank, line, stream: stream.clone() }).await.is_err() {
                        return;
                    }
                }
                return;
            }
            Err(e) if api_status(&e).is_some() => {
                let line = format!(
                    "mflow: cannot read the log of failed pod {}: {}",
                    instance.name,
                    crate::error::describe(&e)
                );
                let _ = tx.send(LogLine { rank: None, line, stream: None }).await;
                return;
            }
            Err(_) => backoff.wait().await,
        }
    }
}

/// Where a followed log is: the time of its newest line and how many lines carried that time,
/// so that a stream opened again from that second skips exactly the lines already passed on.
#[derive(Default)]
struct Cursor {
    last: Option<Timestamp>,
    at_last: usize,
    /// Lines stamped `last` still to skip in the stream just opened.
    replay: usize,
}

impl Cursor {
    /// `sinceTime` for the next stream: the second of the newest line (the server counts whole
    /// seconds).
    fn since(&self) -> Option<Timestamp> {
        let last = self.last?;
        Timestamp::from_second(last.as_second()).ok()
    }

    fn reopen(&mut self) {
        self.replay = self.at_last;
    }

    /// The text of a `timestamps=true` line when it is new, cut to [`MAX_LINE`].
    fn fresh(&mut self, raw: &str) -> Option<String> {
        let (stamp, text) = match raw.split_once(' ') {
            Some((t, text)) => match t.parse::<Timestamp>() {
                Ok(t) => (Some(t), text),
                Err(_) => (None, raw),
            },
            None => match raw.parse::<Timestamp>() {
                Ok(t) => (Some(t), ""),
                Err(_) => (None, raw),
            },
        };
        if let Some(t) = stamp {
            match self.last {
                Some(last) if t < last => return None,
                Some(last) if t == last => {
                    if self.replay > 0 {
                        self.replay -= 1;
                        return None;
                    }
                    self.at_last += 1;
                }
                _ => {
                    self.last = Some(t);
                    self.at_last = 1;
                    self.replay = 0;
                }
            }
        }
        Some(cut(text, MAX_LINE))
    }
}

fn cut(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

/// Waits between attempts to reach the API server: 250 ms, doubling up to 5 s.
#[derive(Default)]
struct Backoff(u32);

impl Backoff {
    async fn wait(&mut self) {
        let ms = (250u64 << self.0.min(5)).min(5000);
        self.0 += 1;
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

    fn reset(&mut self) {
        self.0 = 0;
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

    #[test]
    fn a_reopened_stream_skips_exactly_the_lines_already_passed_on() {
        let mut c = Cursor::default();
        let first = ["2026-01-01T00:00:01.5Z a", "2026-01-01T00:00:02.25Z b", "2026-01-01T00:00:02.25Z c"];
        let got: Vec<String> = first.iter().filter_map(|l| c.fresh(l)).collect();
        assert_eq!(got, ["a", "b", "c"]);
        // The server is asked from the second of the newest line, and sends it all again.
        assert_eq!(c.since().unwrap().to_string(), "2026-01-01T00:00:02Z");
        c.reopen();
        let again = [
            "2026-01-01T00:00:02.1Z x",
            "2026-01-01T00:00:02.25Z b",
            "2026-01-01T00:00:02.25Z c",
            "2026-01-01T00:00:02.25Z d",
            "2026-01-01T00:00:03Z e",
        ];
        let got: Vec<String> = again.iter().filter_map(|l| c.fresh(l)).collect();
        assert_eq!(got, ["d", "e"]);
        // A line without a time is passed on as it is.
        assert_eq!(c.fresh("no time here").as_deref(), Some("no time here"));
        assert_eq!(c.fresh("2026-01-01T00:00:04Z").as_deref(), Some(""), "an empty line keeps its time");
    }
}
