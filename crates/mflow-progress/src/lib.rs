//! The progress protocol between mflow and its stages.
//!
//! A stage learns where to report from `MFLOW_PROGRESS`: the path of a file to which it appends
//! one JSON object per line ([`Event`]). mflow tails that file and draws the live display. When
//! the variable is absent (a standalone command such as `mflow convert`), the reporter draws an
//! indicatif bar on an interactive terminal and stays quiet otherwise.
//!
//! Python workloads write the same lines; see `workloads/mflow_workloads/events.py`. A stage may
//! also name the class of its own failure ([`FailureClass`]) in its `MFLOW_STATUS` file.

pub use mflow_contract::workload::Progress as Event;
pub use mflow_contract::FailureClass;

use std::fs::{File, OpenOptions};
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// Environment variable naming the progress file.
pub const ENV: &str = mflow_contract::vars::PROGRESS;

/// Smallest interval between two progress lines, so that a hot loop costs nothing.
const MIN_INTERVAL: Duration = Duration::from_millis(200);

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

    /// Counts `n` more. The count never goes above the total: a producer that would take it
    /// there counts something its total left out, which debug builds (and so every test) say.
    pub fn inc(&self, n: u64) {
        let mut past = 0;
        let prev = self
            .done
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |d| {
                let want = d.saturating_add(n);
                past = self.total.map_or(0, |t| want.saturating_sub(t));
                Some(want - past)
            })
            .expect("the update always gives a value");
        self.over(past);
        self.publish(prev.saturating_add(n).min(self.total.unwrap_or(u64::MAX)), false);
    }

    /// Sets the count, held to the total as [`Reporter::inc`] holds it.
    pub fn set(&self, done: u64) {
        let past = self.total.map_or(0, |t| done.saturating_sub(t));
        self.over(past);
        self.done.store(done - past, Ordering::Relaxed);
        self.publish(done - past, false);
    }

    fn over(&self, past: u64) {
        debug_assert!(
            past == 0,
            "progress `{}` counted {past} {} past its total {:?}: its total leaves out what it counts",
            self.label,
            self.unit,
            self.total
        );
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
    let pos = if unit == "bytes" {
        "{bytes}/{total_bytes} {binary_bytes_per_sec}"
    } else {
        "{human_pos}/{human_len} {per_sec}"
    };
    let tpl = format!("{label} [{{elapsed_precise}}] {{wide_bar}} {pos} ETA {{eta}} {{msg}}");
    b.set_style(ProgressStyle::with_template(&tpl).unwrap_or_else(|_| ProgressStyle::default_bar()));
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_round_trip_and_garbage_is_ignored() {
        let ev = Event {
            label: "train".into(),
            done: 3,
            total: Some(10),
            unit: "it".into(),
            message: Some("loss 2.5".into()),
        };
        let line = serde_json::to_string(&ev).unwrap();
        assert_eq!(Event::parse(&line), Some(ev));
        assert_eq!(Event::parse("not json"), None);
    }

    fn to_file(path: &std::path::Path, total: u64) -> Reporter {
        let file = OpenOptions::new().create(true).append(true).open(path).unwrap();
        Reporter {
            label: "convert".into(),
            unit: "bytes".into(),
            total: Some(total),
            done: AtomicU64::new(0),
            message: Mutex::new(None),
            sink: Sink::File(Mutex::new((file, Instant::now() - MIN_INTERVAL))),
        }
    }

    #[test]
    fn counts_from_many_threads_end_at_the_total_and_never_read_above_it() {
        let dir = tempfile_dir("threads");
        let path = dir.join("progress.jsonl");
        let r = to_file(&path, 8 * 1000 * 7);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| (0..1000).for_each(|_| r.inc(7)));
            }
        });
        r.finish();
        let events: Vec<Event> = std::fs::read_to_string(&path).unwrap().lines().filter_map(Event::parse).collect();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(events.last().map(|e| (e.done, e.total)), Some((56_000, Some(56_000))), "{events:?}");
        assert!(events.iter().all(|e| e.done <= 56_000), "{events:?}");
    }

    /// A producer whose total leaves out what it counts is a bug every test build says.
    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "progress `convert` counted 20 bytes past its total Some(100)")]
    fn counting_past_the_total_is_told_in_debug_builds() {
        let dir = tempfile_dir("past");
        let r = to_file(&dir.join("progress.jsonl"), 100);
        r.inc(60);
        r.inc(60);
    }

    /// Elsewhere the count is held to the total.
    #[test]
    #[cfg(not(debug_assertions))]
    fn counting_past_the_total_reads_as_the_total() {
        let dir = tempfile_dir("held");
        let path = dir.join("progress.jsonl");
        let r = to_file(&path, 100);
        r.inc(60);
        r.inc(60);
        r.set(500);
        r.finish();
        let events: Vec<Event> = std::fs::read_to_string(&path).unwrap().lines().filter_map(Event::parse).collect();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(events.iter().all(|e| e.done <= 100), "{events:?}");
    }

    fn tempfile_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("mflow-progress-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
