//! A local step's output: every line into the attempt log and, as a run event, to the display.
//! A line is bounded: a stage printing a gigabyte without a line end is read a piece at a time,
//! each piece a line of its own, and the log says where a line was split.

use std::fs::File;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backend::{Job, Line, Lines};

/// The longest line kept whole; a longer one is split into pieces of this size.
pub const MAX_LINE: usize = 1 << 20;

/// A line of mflow's own about the stage, in its log and on the console.
pub(super) async fn note(job: &Job, log: &Arc<Mutex<Log>>, lines: &Lines, text: String) {
    if let Ok(mut f) = log.lock() {
        f.write(text.as_bytes());
    }
    lines.send(Line { stage: job.stage.clone(), attempt: job.attempt, text }).await;
}

/// The attempt's log, created with its directory at the first line: a stage that prints nothing
/// costs no files.
pub struct Log {
    path: std::path::PathBuf,
    file: Option<File>,
}

impl Log {
    pub fn new(path: std::path::PathBuf) -> Log {
        Log { path, file: None }
    }

    pub(super) fn write(&mut self, line: &[u8]) {
        if self.file.is_none() {
            if let Some(dir) = self.path.parent() {
                let _ = std::fs::create_dir_all(dir);
            }
            self.file = File::create(&self.path).ok();
        }
        if let Some(f) = &mut self.file {
            let _ = f.write_all(line);
            if !line.ends_with(b"\n") {
                let _ = f.write_all(b"\n");
            }
        }
    }
}

/// How long a pipe is waited on, in all, once every process of its step is gone: a process
/// mflow could not end (another user's) may hold it open for ever.
const DRAIN: Duration = Duration::from_secs(1);
/// How much more is read from a pipe once every process of its step is gone: more than any pipe
/// holds, so that only a process still writing (one mflow could not end) is cut off.
const DRAIN_BYTES: usize = 16 << 20;

/// Reads one of a step's pipes, a line at a time (at most [`MAX_LINE`] bytes each), to its end
/// or until, after `ended` (every process of the step is gone), it was waited on [`DRAIN`] or
/// gave [`DRAIN_BYTES`] more. Time spent waiting for the printer does not count: a slow reader
/// of mflow's output cuts nothing off. `false` when it gave up before the end.
pub(super) async fn pump<R: AsyncRead + Unpin>(
    r: R,
    stage: String,
    attempt: u32,
    log: Arc<Mutex<Log>>,
    lines: Lines,
    ended: CancellationToken,
) -> bool {
    let mut pipe = Pipe { reader: BufReader::with_capacity(64 << 10, r), ended, waited: Duration::ZERO, after: 0 };
    let mut buf = Vec::new();
    let mut said_split = false;
    loop {
        buf.clear();
        let split = match pipe.line(&mut buf).await {
            Ok(Some(split)) => split,
            Ok(None) | Err(_) => break,
        };
        if let Ok(mut f) = log.lock() {
            f.write(&buf);
            if split && !said_split {
                said_split = true;
                f.write(
                    format!("[mflow: a line longer than {MAX_LINE} bytes is split into lines of that size]").as_bytes(),
                );
            }
        }
        let text = String::from_utf8_lossy(&buf).trim_end_matches(['\n', '\r']).to_string();
        lines.send(Line { stage: stage.clone(), attempt, text }).await;
    }
    !pipe.gave_up()
}

/// A step's pipe as [`pump`] reads it.
struct Pipe<R> {
    reader: BufReader<R>,
    ended: CancellationToken,
    /// Time waited for the pipe after `ended`.
    waited: Duration,
    /// Bytes read after `ended`; `usize::MAX` once given up.
    after: usize,
}

impl<R: AsyncRead + Unpin> Pipe<R> {
    fn gave_up(&self) -> bool {
        self.after == usize::MAX
    }

    /// Waits for bytes in the buffer (none at the end); `false` when the pipe is given up.
    async fn ready(&mut self) -> std::io::Result<bool> {
        if !self.ended.is_cancelled() {
            tokio::select! {
                r = self.reader.fill_buf() => return r.map(|_| true),
                () = self.ended.cancelled() => {}
            }
        }
        let left = DRAIN.saturating_sub(self.waited);
        let t0 = Instant::now();
        let filled = tokio::time::timeout(left, self.reader.fill_buf()).await;
        self.waited += t0.elapsed();
        match filled {
            Ok(r) => r.map(|_| self.after <= DRAIN_BYTES),
            Err(_) => Ok(false),
        }
    }

    fn consume(&mut self, n: usize) {
        self.reader.consume(n);
        if self.ended.is_cancelled() {
            self.after = self.after.saturating_add(n);
        }
    }

    /// Reads a line into `buf`, at most [`MAX_LINE`] bytes of it besides its line end:
    /// `Some(true)` when it was cut there, `None` at the end.
    async fn line(&mut self, buf: &mut Vec<u8>) -> std::io::Result<Option<bool>> {
        loop {
            if self.gave_up() || !self.ready().await? {
                self.after = usize::MAX;
                return Ok((!buf.is_empty()).then_some(false));
            }
            let available = self.reader.buffer();
            if available.is_empty() {
                return Ok((!buf.is_empty()).then_some(false));
            }
            // A line of exactly MAX_LINE bytes ends with its line end, not with a cut.
            if buf.len() == MAX_LINE {
                let end = [&b"\n"[..], b"\r\n"].into_iter().find(|e| available.starts_with(e));
                if let Some(end) = end {
                    buf.extend_from_slice(end);
                    self.consume(end.len());
                }
                return Ok(Some(end.is_none()));
            }
            let room = MAX_LINE - buf.len();
            let (take, done) = match available.iter().take(room + 1).position(|&b| b == b'\n') {
                Some(i) => (i + 1, true),
                None => (available.len().min(room), false),
            };
            buf.extend_from_slice(&available[..take]);
            self.consume(take);
            if done {
                return Ok(Some(false));
            }
        }
    }
}
