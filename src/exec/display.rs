//! What a run shows while it works: a live multi-line display on a terminal, plain lines
//! elsewhere (pipes, CI=true), or JSON lines with `--log-format json`.

mod warnings;

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
    /// Each stage's progress rate, for its ETA.
    rates: BTreeMap<String, Rate>,
    /// Python warnings already shown on the console in this run.
    warnings: warnings::Warnings,
}

impl Display {
    pub fn new(mode: Mode, names: &[String]) -> Display {
        let multi = MultiProgress::with_draw_target(if mode == Mode::Live { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() });
        let width = names.iter().map(String::len).max().unwrap_or(4).min(24);
        Display { mode, multi, bars: BTreeMap::new(), last_plain: BTreeMap::new(), width, pending: String::new(), rates: BTreeMap::new(), warnings: Default::default() }
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

    /// One line of a stage's output (the attempt log has every line already).
    pub fn line(&mut self, stage: &str, text: &str) {
        if self.mode == Mode::Json {
            // Every line as the stage printed it: JSON is read by programs, and a Kubernetes
            // driver's events are filtered by the display that renders them on the laptop.
            self.json(serde_json::json!({"event": "output", "stage": stage, "line": text}));
        } else {
            // Third-party Python warnings are shown once each, shortened.
            let Some(text) = self.warnings.filter(stage, text) else { return };
            self.say(format!("{:>w$} | {text}", stage, w = self.width));
        }
        self.flush();
    }

    pub fn status(&mut self, stage: &str, what: &str, detail: &str) {
        if matches!(what, "started" | "retrying" | "succeeded" | "failed" | "cancelled") {
            // An attempt warms up again and is timed from its own start.
            self.rates.remove(stage);
        }
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

    /// A stage's newest progress event; `elapsed` is the time since its attempt started.
    pub fn progress(&mut self, stage: &str, ev: &Event, elapsed: Duration) {
        let rate = match self.rates.get_mut(stage) {
            Some(r) => r,
            None => self.rates.entry(stage.to_string()).or_default(),
        };
        let eta_s = rate.observe(ev.done, ev.total, elapsed.as_secs_f64()).map(f64::round);
        let eta = match eta_s {
            Some(s) => format!(" ETA {}", humantime::format_duration(Duration::from_secs(s as u64))),
            None => String::new(),
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
            Mode::Json => self.json(serde_json::json!({"event": "progress", "stage": stage, "label": ev.label, "done": ev.done, "total": ev.total, "unit": ev.unit, "message": ev.message, "elapsed_s": elapsed.as_secs_f64(), "eta_s": eta_s})),
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

/// Events with new work past the first one that an ETA needs: one step is noise, and the second
/// can still be slow (a second compilation, data loader workers filling their queues).
const MIN_STEPS: u32 = 3;

/// Seconds over which older steps fade out of the rate (an exponential moving average over
/// time): long enough to smooth noisy steps, short enough to follow a rate that changes.
const RATE_WINDOW_S: f64 = 120.0;

/// A stage's rate of progress, without its warm-up. The time to a stage's first counted step
/// includes compiling, loading data and the rendezvous: an ETA from it was 3h for a 4-minute
/// stage. So the rate is measured from the first event with work done, as the ratio of two
/// decayed sums (work done and seconds taken) over the events since.
#[derive(Debug, Default)]
struct Rate {
    /// `done` and elapsed seconds of the newest counted event.
    last: Option<(u64, f64)>,
    done: f64,
    secs: f64,
    /// Events past the first that counted more work.
    steps: u32,
}

impl Rate {
    /// Takes an event's count at `elapsed` seconds into the attempt; the seconds left, once
    /// there is evidence enough.
    fn observe(&mut self, done: u64, total: Option<u64>, elapsed: f64) -> Option<f64> {
        match self.last {
            // Counting restarted (a new attempt whose start was not announced): measure anew.
            Some((d, t)) if done < d || elapsed < t => *self = Rate::default(),
            _ => {}
        }
        match self.last {
            None if done > 0 => self.last = Some((done, elapsed)),
            None => {}
            Some((d, t)) if done > d => {
                let dt = elapsed - t;
                let keep = (-dt / RATE_WINDOW_S).exp();
                self.done = self.done * keep + (done - d) as f64;
                self.secs = self.secs * keep + dt;
                self.steps += 1;
                self.last = Some((done, elapsed));
            }
            // The same count with a new message: the time runs on into the next step.
            Some(_) => {}
        }
        let left = total?.checked_sub(done).filter(|&l| l > 0)?;
        (self.steps >= MIN_STEPS && self.secs > 0.0 && self.done > 0.0).then(|| self.secs / self.done * left as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (done, elapsed seconds) events of one attempt, and the ETA after each.
    fn etas(events: &[(u64, f64)], total: u64) -> Vec<Option<f64>> {
        let mut r = Rate::default();
        events.iter().map(|&(d, t)| r.observe(d, Some(total), t)).collect()
    }

    #[test]
    fn a_slow_first_step_does_not_set_the_eta() {
        // Step 1 takes 60 s (compiling, loading), every step after it 1 s.
        let events: Vec<(u64, f64)> = (1..=20).map(|i| (i, 59.0 + i as f64)).collect();
        let e = etas(&events, 200);
        assert_eq!(e[..3], [None, None, None], "no ETA before three steps past the first");
        for (i, eta) in e.iter().enumerate().skip(3) {
            let left = (200 - events[i].0) as f64;
            let eta = eta.unwrap_or_else(|| panic!("an ETA at step {}", i + 1));
            assert!((eta - left).abs() < 0.01 * left, "step {}: ETA {eta} s for {left} steps of 1 s", i + 1);
        }
    }

    #[test]
    fn the_eta_follows_a_changed_rate_and_survives_skipped_events() {
        // Events are read 4 times a second, so some are never seen: 5 steps per event here.
        let mut events: Vec<(u64, f64)> = vec![(0, 0.5), (5, 30.0)];
        events.extend((2..=40).map(|i| (5 * i, 30.0 + 5.0 * (i - 1) as f64)));
        // Then each step takes 2 s for ten minutes.
        events.extend((1..=60).map(|i| (200 + 5 * i, 225.0 + 10.0 * i as f64)));
        let e = etas(&events, 1000);
        assert_eq!(e[40], Some(800.0), "1 s a step");
        let eta = e.last().unwrap().unwrap();
        let left = 1000.0 - 500.0;
        assert!((eta - 2.0 * left).abs() < 0.05 * 2.0 * left, "ETA {eta} s for {left} steps of 2 s");
    }

    #[test]
    fn an_event_without_new_work_or_a_restart_is_no_evidence() {
        let mut r = Rate::default();
        assert_eq!(r.observe(0, Some(10), 1.0), None, "nothing done yet");
        // A new message at the same count is no step.
        for (d, t) in [(1, 40.0), (1, 40.5), (2, 41.0), (3, 42.0)] {
            assert_eq!(r.observe(d, Some(10), t), None);
        }
        assert_eq!(r.observe(4, Some(10), 43.0), Some(6.0));
        assert_eq!(r.observe(10, Some(10), 50.0), None, "nothing left");
        // A new attempt counts from 0 again, and warms up again.
        assert_eq!(r.observe(1, Some(10), 30.0), None);
        assert_eq!(r.observe(4, Some(10), 33.0), None);
        assert_eq!(r.observe(2, None, 1.0), None, "no total");
    }
}
