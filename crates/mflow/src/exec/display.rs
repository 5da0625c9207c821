//! What a run shows while it works: a live multi-line display on a terminal, plain lines
//! elsewhere (pipes, CI=true), or JSON lines with `--log-format json`.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use mflow_progress::Event;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    Live,
    Plain,
    Json,
}

impl Mode {
    pub fn detect(json: bool) -> Mode {
        if json {
            Mode::Json
        } else if std::io::stderr().is_terminal() && std::env::var_os("CI").is_none() {
            Mode::Live
        } else {
            Mode::Plain
        }
    }
}

pub struct Display {
    mode: Mode,
    multi: MultiProgress,
    bars: BTreeMap<String, ProgressBar>,
    last_plain: BTreeMap<String, Instant>,
    width: usize,
    /// "cached" lines not yet written: a no-op run of a large DAG writes them in one go.
    pending: String,
}

impl Display {
    pub fn new(mode: Mode, names: &[String]) -> Display {
        let multi = MultiProgress::with_draw_target(if mode == Mode::Live { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() });
        let width = names.iter().map(String::len).max().unwrap_or(4).min(24);
        Display { mode, multi, bars: BTreeMap::new(), last_plain: BTreeMap::new(), width, pending: String::new() }
    }

    fn say(&mut self, text: String) {
        match self.mode {
            Mode::Live => {
                self.flush();
                let _ = self.multi.println(text);
            }
            _ => self.emit(text),
        }
    }

    fn json(&mut self, v: serde_json::Value) {
        self.emit(v.to_string());
    }

    /// Queues a line; anything but a cache hit is written at once, with what was queued before it.
    fn emit(&mut self, text: String) {
        self.pending.push_str(&text);
        self.pending.push('\n');
    }

    /// Writes queued lines in one write (stderr is unbuffered).
    pub fn flush(&mut self) {
        use std::io::Write;
        if !self.pending.is_empty() {
            let _ = std::io::stderr().lock().write_all(self.pending.as_bytes());
            self.pending.clear();
        }
    }

    pub fn line(&mut self, stage: &str, text: &str) {
        if self.mode == Mode::Json {
            self.json(serde_json::json!({"event": "output", "stage": stage, "line": text}));
        } else {
            self.say(format!("{:>w$} | {text}", stage, w = self.width));
        }
        self.flush();
    }

    pub fn status(&mut self, stage: &str, what: &str, detail: &str) {
        if self.mode == Mode::Json {
            self.json(serde_json::json!({"event": what, "stage": stage, "detail": detail}));
            if what != "cached" {
                self.flush();
            }
            return;
        }
        let mark = match what {
            "started" => "▶",
            "cached" => "•",
            "succeeded" => "✓",
            "failed" => "✗",
            "retrying" => "↻",
            "skipped" => "-",
            "cancelled" => "■",
            _ => "·",
        };
        self.say(format!("{mark} {stage} {what}{}{detail}", if detail.is_empty() { "" } else { ": " }));
        if what != "cached" {
            self.flush();
        }
        if what == "started" && self.mode == Mode::Live {
            let bar = self.multi.add(ProgressBar::new_spinner());
            bar.set_style(ProgressStyle::with_template("  {prefix:.bold} [{elapsed_precise}] {wide_msg}").unwrap());
            bar.set_prefix(stage.to_string());
            bar.enable_steady_tick(Duration::from_millis(200));
            self.bars.insert(stage.to_string(), bar);
        }
        if matches!(what, "succeeded" | "failed" | "cancelled" | "retrying") {
            if let Some(b) = self.bars.remove(stage) {
                b.finish_and_clear();
                self.multi.remove(&b);
            }
        }
    }

    pub fn progress(&mut self, stage: &str, ev: &Event, elapsed: Duration) {
        let eta = match ev.total {
            Some(t) if ev.done > 0 && t > ev.done => {
                let secs = elapsed.as_secs_f64() * (t - ev.done) as f64 / ev.done as f64;
                format!(" ETA {}", humantime::format_duration(Duration::from_secs(secs.round() as u64)))
            }
            _ => String::new(),
        };
        let count = match ev.total {
            Some(t) => format!("{} {}/{} {}", ev.label, ev.done, t, ev.unit),
            None => format!("{} {} {}", ev.label, ev.done, ev.unit),
        };
        let msg = format!("{count}{eta} {}", ev.message.clone().unwrap_or_default());
        match self.mode {
            Mode::Live => {
                if let Some(b) = self.bars.get(stage) {
                    b.set_message(msg);
                }
            }
            Mode::Plain => {
                let due = self.last_plain.get(stage).is_none_or(|t| t.elapsed() >= Duration::from_secs(10));
                if due {
                    self.last_plain.insert(stage.to_string(), Instant::now());
                    self.say(format!("{:>w$} : {msg}", stage, w = self.width));
                }
            }
            Mode::Json => self.json(serde_json::json!({"event": "progress", "stage": stage, "label": ev.label, "done": ev.done, "total": ev.total, "unit": ev.unit, "message": ev.message, "elapsed_s": elapsed.as_secs_f64()})),
        }
        self.flush();
    }

    pub fn finish(&mut self) {
        self.flush();
        for (_, b) in std::mem::take(&mut self.bars) {
            b.finish_and_clear();
        }
        let _ = self.multi.clear();
    }
}
