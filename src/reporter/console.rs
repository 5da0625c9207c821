//! The console: a live multi-line display on a terminal, plain lines elsewhere (pipes,
//! CI=true). It reads the run's events and nothing else, so a run in a cluster, followed from a
//! laptop, looks as a local run does.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use mflow_contract::event::{AttemptEnd, RunEvent};
use mflow_contract::record::{AttemptOutcome, RunRecord, RunStatus};

use super::warnings::Warnings;
use super::{Reporter, Stamp};

/// How the events of a run are shown.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    Live,
    Plain,
    /// Only failures, warnings and the end of the run (`-q`).
    Quiet,
    Json,
}

impl Mode {
    pub fn detect(json: bool, quiet: bool) -> Mode {
        if json {
            Mode::Json
        } else if quiet {
            Mode::Quiet
        } else if std::io::stderr().is_terminal() && std::env::var_os("CI").is_none() {
            Mode::Live
        } else {
            Mode::Plain
        }
    }
}

/// The console reporter (modes `Live` and `Plain`).
pub struct Console {
    live: bool,
    quiet: bool,
    multi: MultiProgress,
    bars: BTreeMap<String, ProgressBar>,
    last_plain: BTreeMap<String, Instant>,
    width: usize,
    /// Lines not yet written: a no-op run of a large DAG writes its "cached" lines in one go.
    pending: String,
    /// Python warnings already shown on the console in this run.
    warnings: Warnings,
}

impl Console {
    pub fn new(mode: Mode) -> Console {
        let live = mode == Mode::Live;
        let target = if live { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() };
        Console {
            live,
            quiet: mode == Mode::Quiet,
            multi: MultiProgress::with_draw_target(target),
            bars: BTreeMap::new(),
            last_plain: BTreeMap::new(),
            width: 4,
            pending: String::new(),
            warnings: Warnings::default(),
        }
    }

    fn say(&mut self, text: String) {
        if self.live {
            self.flush();
            let _ = self.multi.println(text);
        } else {
            self.pending.push_str(&text);
            self.pending.push('\n');
        }
    }

    /// Writes queued lines in one write (stderr is unbuffered). A message mflow cannot write
    /// (the terminal of a closed ssh session is gone) is dropped: the run goes on.
    pub fn flush(&mut self) {
        use std::io::Write;
        if !self.pending.is_empty() {
            let _ = std::io::stderr().lock().write_all(self.pending.as_bytes());
            self.pending.clear();
        }
    }

    /// A status line of a stage: `mark stage what: detail`.
    fn status(&mut self, stage: &str, mark: &str, what: &str, detail: &str) {
        let sep = if detail.is_empty() { "" } else { ": " };
        self.say(format!("{mark} {stage} {what}{sep}{detail}"));
    }

    fn start_bar(&mut self, stage: &str) {
        if !self.live {
            return;
        }
        let bar = self.multi.add(ProgressBar::new_spinner());
        bar.set_style(ProgressStyle::with_template("  {prefix:.bold} [{elapsed_precise}] {wide_msg}").unwrap());
        bar.set_prefix(stage.to_string());
        bar.enable_steady_tick(Duration::from_millis(200));
        self.bars.insert(stage.to_string(), bar);
    }

    fn end_bar(&mut self, stage: &str) {
        if let Some(b) = self.bars.remove(stage) {
            b.finish_and_clear();
            self.multi.remove(&b);
        }
    }

    fn line(&mut self, stage: &str, text: &str) {
        // Third-party Python warnings are shown once each, shortened.
        let Some(text) = self.warnings.filter(stage, text) else { return };
        self.say(format!("{:>w$} | {text}", stage, w = self.width));
    }

    #[allow(clippy::too_many_arguments)]
    fn progress(
        &mut self,
        stage: &str,
        label: &str,
        done: u64,
        total: Option<u64>,
        unit: &str,
        message: Option<&str>,
        eta_s: Option<f64>,
    ) {
        let eta = match eta_s {
            Some(s) => format!(" ETA {}", humantime::format_duration(Duration::from_secs(s.max(0.0) as u64))),
            None => String::new(),
        };
        let count = match total {
            Some(t) => format!("{label} {}/{t} {unit}", done.min(t)),
            None => format!("{label} {done} {unit}"),
        };
        let msg = format!("{count}{eta} {}", message.unwrap_or_default());
        if self.live {
            if let Some(b) = self.bars.get(stage) {
                b.set_message(msg);
            }
        } else if self.last_plain.get(stage).is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
            self.last_plain.insert(stage.to_string(), Instant::now());
            self.say(format!("{:>w$} : {msg}", stage, w = self.width));
        }
    }

    fn attempt_ended(&mut self, stage: &str, end: &AttemptEnd) {
        let Some(retry) = &end.retry else { return };
        self.end_bar(stage);
        let AttemptOutcome::Failed(class) = end.outcome else { return };
        let wait = humantime::format_duration(Duration::from_millis((retry.after_s.max(0.0) * 1000.0) as u64));
        let message = end.message.as_deref().unwrap_or_default();
        self.status(stage, "↻", "retrying", &format!("{class}: {message}; attempt {} in {wait}", retry.attempt));
    }

    fn finished(&mut self, record: &RunRecord, path: &str) {
        let c = record.counts();
        let left = match c.interrupted {
            0 => String::new(),
            n => format!(", {n} left running on the cluster (run again to reattach)"),
        };
        self.say(format!(
            "run {} {}: {} ran, {} cached, {} failed, {} skipped{left}  (record: {path})",
            record.id,
            record.status.as_str(),
            c.ran,
            c.cached,
            c.failed,
            c.skipped
        ));
        for (name, g) in record.gates() {
            let value = g.value.map(|v| format!("{v:.4}")).unwrap_or("missing".into());
            let verdict = if g.passed { "pass" } else { "FAIL" };
            self.say(format!("  gate {name}.{} {} : {value} -> {verdict}", g.metric, g.condition));
        }
    }
}

impl Reporter for Console {
    fn event(&mut self, _run: &str, _at: &Stamp, ev: &RunEvent, record: &RunRecord) {
        if self.quiet && !quiet_shows(ev) {
            return;
        }
        match ev {
            RunEvent::RunStarted { stages, .. } => {
                self.width = stages.iter().map(|s| s.name.len()).max().unwrap_or(4).min(24);
            }
            RunEvent::StageCached { stage, key, by_another_run, .. } => {
                let detail = if *by_another_run { "computed by another run" } else { crate::cache::key::short(key) };
                self.status(stage, "•", "cached", detail);
                // A no-op run of a large DAG writes its cache hits in one go.
                return;
            }
            RunEvent::StageSkipped { stage, reason } => self.status(stage, "-", "skipped", reason),
            RunEvent::AttemptStarted { stage, attempt, engine, .. } => {
                // The engine goes on the line that says the stage started: where a reader looks first.
                let detail =
                    [(*attempt > 1).then(|| format!("attempt {attempt}")), engine.as_ref().map(ToString::to_string)];
                let detail = detail.into_iter().flatten().collect::<Vec<_>>().join("; ");
                self.status(stage, "▶", "started", &detail);
                self.start_bar(stage);
            }
            RunEvent::Output { stage, line, .. } => self.line(stage, line),
            RunEvent::Progress { stage, label, done, total, unit, message, eta_s, .. } => {
                self.progress(stage, label, *done, *total, unit, message.as_deref(), *eta_s)
            }
            RunEvent::AttemptEnded { stage, end, .. } => self.attempt_ended(stage, end),
            RunEvent::StageSucceeded { stage, duration_s, .. } => {
                self.end_bar(stage);
                self.status(stage, "✓", "succeeded", &format!("{duration_s:.1}s"));
            }
            RunEvent::StageFailed { stage, class, message } => {
                self.end_bar(stage);
                let cancelled = *class == mflow_contract::FailureClass::Cancelled;
                let (mark, what) = if cancelled { ("■", "cancelled") } else { ("✗", "failed") };
                self.status(stage, mark, what, &format!("{class}: {message}"));
            }
            RunEvent::StageInterrupted { stage, message } => {
                self.end_bar(stage);
                self.status(stage, "·", "interrupted", message);
            }
            RunEvent::Warning { stage, message } => match stage {
                Some(stage) => self.status(stage, "·", "warning", message),
                None => self.say(format!("mflow: warning: {message}")),
            },
            RunEvent::RunFinished { record: path, status, .. } => {
                self.flush();
                for (_, b) in std::mem::take(&mut self.bars) {
                    b.finish_and_clear();
                }
                let _ = self.multi.clear();
                if *status != RunStatus::Running {
                    self.finished(record, path);
                }
            }
            RunEvent::StageKeyed { .. }
            | RunEvent::StageCancelled { .. }
            | RunEvent::StageStarted { .. }
            | RunEvent::GatesChecked { .. } => return,
        }
        self.flush();
    }

    fn text(&mut self, line: &str) {
        self.say(line.to_string());
        self.flush();
    }

    fn flush(&mut self) {
        Console::flush(self);
    }

    fn finish(&mut self, _record: &RunRecord) {
        Console::flush(self);
        for (_, b) in std::mem::take(&mut self.bars) {
            b.finish_and_clear();
        }
        let _ = self.multi.clear();
    }
}

/// What `-q` still shows: failures, interruptions, warnings and the end of the run.
fn quiet_shows(ev: &RunEvent) -> bool {
    matches!(
        ev,
        RunEvent::RunStarted { .. }
            | RunEvent::StageFailed { .. }
            | RunEvent::StageInterrupted { .. }
            | RunEvent::Warning { .. }
            | RunEvent::RunFinished { .. }
    )
}
