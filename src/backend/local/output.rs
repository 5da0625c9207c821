//! A local step's output: every line into the attempt log and, as a run event, to the display.
//! A line is bounded: a stage printing a gigabyte without a line end is read a piece at a time,
//! each piece a line of its own, and the log says where a line was split.

use std::fs::File;
use std::io::Write;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::sync::mpsc;

use crate::backend::{Job, Line};

/// The longest line kept whole; a longer one is split into pieces of this size.
pub const MAX_LINE: usize = 1 << 20;

/// A line of mflow's own about the stage, in its log and on the console.
pub(super) fn note(job: &Job, log: &Arc<Mutex<Log>>, lines: &mpsc::UnboundedSender<Line>, text: String) {
    if let Ok(mut f) = log.lock() {
        f.write(text.as_bytes());
    }
    let _ = lines.send(Line { stage: job.stage.clone(), attempt: job.attempt, text });
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

/// Reads one of a step's pipes to its end, a line at a time (at most [`MAX_LINE`] bytes each).
pub(super) async fn pump<R: AsyncRead + Unpin>(
    r: R,
    stage: String,
    attempt: u32,
    log: Arc<Mutex<Log>>,
    lines: mpsc::UnboundedSender<Line>,
) {
    let mut reader = BufReader::with_capacity(64 << 10, r);
    let mut buf = Vec::new();
    let mut said_split = false;
    loop {
        buf.clear();
        let split = match read_line(&mut reader, &mut buf).await {
            Ok(None) => break,
            Ok(Some(split)) => split,
            Err(_) => break,
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
        let _ = lines.send(Line { stage: stage.clone(), attempt, text });
    }
}

/// Reads a line into `buf`, at most [`MAX_LINE`] bytes of it: `Some(true)` when it was cut
/// there, `None` at the end.
async fn read_line<R: AsyncRead + Unpin>(
    reader: &mut BufReader<R>,
    buf: &mut Vec<u8>,
) -> std::io::Result<Option<bool>> {
    loop {
        let available = reader.fill_buf().await?;
        if available.is_empty() {
            return Ok((!buf.is_empty()).then_some(false));
        }
        let room = MAX_LINE - buf.len();
        let (take, done) = match available.iter().take(room).position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (available.len().min(room), false),
        };
        buf.extend_from_slice(&available[..take]);
        reader.consume(take);
        if done {
            return Ok(Some(false));
        }
        if buf.len() >= MAX_LINE {
            return Ok(Some(true));
        }
    }
}
