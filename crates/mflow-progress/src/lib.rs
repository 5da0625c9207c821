//! The progress protocol between mflow and its stages.
//!
//! A stage learns where to report from `MFLOW_PROGRESS`: the path of a file to which it appends
//! one JSON object per line ([`Event`]). mflow tails that file and draws the live display. When
//! the variable is absent (a standalone command such as `mflow convert`), the reporter draws an
//! indicatif bar on an interactive terminal and stays quiet otherwise.
//!
//! Python workloads write the same lines; see `workloads/mflow_workloads/events.py`. A stage may
//! also name the class of its own failure ([`FailureClass`]) in its `MFLOW_STATUS` file.

mod class;
pub use class::FailureClass;

use std::fs::{File, OpenOptions};
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

/// Environment variable naming the progress file.
pub const ENV: &str = "MFLOW_PROGRESS";

/// Smallest interval between two progress lines, so that a hot loop costs nothing.
const MIN_INTERVAL: Duration = Duration::from_millis(200);

/// One line of the progress file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// What is being counted ("convert", "tokenize", "train").
    #[serde(default)]
    pub label: String,
    pub done: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total: Option<u64>,
    /// "bytes", "tokens", "it", "files", ...
    #[serde(default)]
    pub unit: String,
    /// A short free-text status, e.g. "loss 3.21".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl Event {
    /// Parses one line; returns `None` for anything that is not an event, so that a stage
    /// writing garbage never disturbs the run.
    pub fn parse(line: &str) -> Option<Event> {
        serde_json::from_str(line.trim()).ok()
    }
}

enum Sink {
    File(Mutex<(File, Instant)>),
    Bar(ProgressBar),
    Quiet,
}

/// Reports progress of one piece of work. Cheap to call from many threads.
pub struct Reporter {
    label: String,
    unit: String,
    total: Option<u64>,
    done: AtomicU64,
    message: Mutex<Option<String>>,
    sink: Sink,
}

impl Reporter {
    /// A reporter that writes to `MFLOW_PROGRESS` when set, draws a bar on a terminal, or
    /// does nothing.
    pub fn new(label: &str, total: Option<u64>, unit: &str) -> Reporter {
        let sink = match std::env::var_os(ENV) {
            Some(path) => match OpenOptions::new().create(true).append(true).open(path) {
                Ok(f) => Sink::File(Mutex::new((f, Instant::now() - MIN_INTERVAL))),
                Err(_) => Sink::Quiet,
            },
            None if std::io::stderr().is_terminal() && std::env::var_os("CI").is_none() => {
                Sink::Bar(bar(label, total, unit))
            }
            None => Sink::Quiet,
        };
        Reporter {
            label: label.to_string(),
            unit: unit.to_string(),
            total,
            done: AtomicU64::new(0),
            message: Mutex::new(None),
            sink,
        }
    }

    /// A reporter that never prints (tests, library use).
    pub fn quiet() -> Reporter {
        Reporter {
            label: String::new(),
            unit: String::new(),
            total: None,
            done: AtomicU64::new(0),
            message: Mutex::new(None),
            sink: Sink::Quiet,
        }
    }

    pub fn inc(&self, n: u64) {
        let done = self.done.fetch_add(n, Ordering::Relaxed) + n;
        self.publish(done, false);
    }

    pub fn set(&self, done: u64) {
        self.done.store(done, Ordering::Relaxed);
        self.publish(done, false);
    }

    pub fn message(&self, msg: impl Into<String>) {
        let msg = msg.into();
        if let Sink::Bar(b) = &self.sink {
            b.set_message(msg.clone());
        }
        *self.message.lock().unwrap() = Some(msg);
        self.publish(self.done.load(Ordering::Relaxed), false);
    }

    /// Writes the final state regardless of the rate limit.
    pub fn finish(&self) {
        let done = self.done.load(Ordering::Relaxed);
        self.publish(done, true);
        if let Sink::Bar(b) = &self.sink {
            b.finish_and_clear();
        }
    }

    fn publish(&self, done: u64, force: bool) {
        // A count that overshoots its estimate never reads as more than all of it.
        let done = self.total.map_or(done, |t| done.min(t));
        match &self.sink {
            Sink::Quiet => {}
            Sink::Bar(b) => b.set_position(done),
            Sink::File(m) => {
                let Ok(mut guard) = m.try_lock() else {
                    if !force {
                        return;
                    }
                    let mut g = m.lock().unwrap();
                    let _ = write_event(&mut g.0, self.event(done));
                    return;
                };
                if force || guard.1.elapsed() >= MIN_INTERVAL {
                    guard.1 = Instant::now();
                    let _ = write_event(&mut guard.0, self.event(done));
                }
            }
        }
    }

    fn event(&self, done: u64) -> Event {
        Event {
            label: self.label.clone(),
            done,
            total: self.total,
            unit: self.unit.clone(),
            message: self.message.lock().unwrap().clone(),
        }
    }
}

impl Drop for Reporter {
    fn drop(&mut self) {
        if let Sink::Bar(b) = &self.sink {
            b.finish_and_clear();
        }
    }
}

fn write_event(f: &mut File, ev: Event) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(&ev).map_err(std::io::Error::other)?;
    line.push(b'\n');
    f.write_all(&line)
}

fn bar(label: &str, total: Option<u64>, unit: &str) -> ProgressBar {
    let b = match total {
        Some(t) => ProgressBar::new(t),
        None => ProgressBar::new_spinner(),
    };
    let pos = if unit == "bytes" { "{bytes}/{total_bytes} {binary_bytes_per_sec}" } else { "{human_pos}/{human_len} {per_sec}" };
    let tpl = format!("{label} [{{elapsed_precise}}] {{wide_bar}} {pos} ETA {{eta}} {{msg}}");
    b.set_style(ProgressStyle::with_template(&tpl).unwrap_or_else(|_| ProgressStyle::default_bar()));
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_round_trip_and_garbage_is_ignored() {
        let ev = Event { label: "train".into(), done: 3, total: Some(10), unit: "it".into(), message: Some("loss 2.5".into()) };
        let line = serde_json::to_string(&ev).unwrap();
        assert_eq!(Event::parse(&line), Some(ev));
        assert_eq!(Event::parse("not json"), None);
    }

    #[test]
    fn progress_never_reads_above_its_total() {
        let dir = std::env::temp_dir().join(format!("mflow-progress-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("progress.jsonl");
        let file = OpenOptions::new().create(true).append(true).open(&path).unwrap();
        let r = Reporter {
            label: "convert".into(),
            unit: "bytes".into(),
            total: Some(100),
            done: AtomicU64::new(0),
            message: Mutex::new(None),
            sink: Sink::File(Mutex::new((file, Instant::now() - MIN_INTERVAL))),
        };
        r.inc(60);
        r.inc(60);
        r.finish();
        let events: Vec<Event> = std::fs::read_to_string(&path).unwrap().lines().filter_map(Event::parse).collect();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(events.last().map(|e| (e.done, e.total)), Some((100, Some(100))), "{events:?}");
        assert!(events.iter().all(|e| e.done <= 100), "{events:?}");
    }
}
