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
}

impl Display {
    pub fn new(mode: Mode, names: &[String]) -> Display {
        let multi = MultiProgress::with_draw_target(if mode == Mode::Live { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() });
        let width = names.iter().map(String::len).max().unwrap_or(4).min(24);
        Display { mode, multi, bars: BTreeMap::new(), last_plain: BTreeMap::new(), width }
    }

    fn say(&self, text: String) {
        match self.mode {
            Mode::Live => {
                let _ = self.multi.println(text);
            }
            _ => emit(text),
        }
    }

    fn json(&self, v: serde_json::Value) {
        emit(v.to_string());
    }

    pub fn line(&self, stage: &str, text: &str) {
        if self.mode == Mode::Json {
            return self.json(serde_json::json!({"event": "output", "stage": stage, "line": text}));
        }
        self.say(format!("{:>w$} | {text}", stage, w = self.width));
    }

    pub fn status(&mut self, stage: &str, what: &str, detail: &str) {
        if self.mode == Mode::Json {
            return self.json(serde_json::json!({"event": what, "stage": stage, "detail": detail}));
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
            Mode::Json => self.json(serde_json::json!({"event": "progress", "stage": stage, "done": ev.done, "total": ev.total, "unit": ev.unit, "message": ev.message})),
        }
    }

    pub fn finish(&mut self) {
        for (_, b) in std::mem::take(&mut self.bars) {
            b.finish_and_clear();
        }
        let _ = self.multi.clear();
    }
}

/// One line to stderr in one write: stderr is unbuffered, and `eprintln!` costs two.
fn emit(mut text: String) {
    use std::io::Write;
    text.push('\n');
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}
