//! Signals: what mflow does when it is asked to stop.
//!
//! Ctrl-C (SIGINT) cancels: running stages are stopped and their TrainJobs deleted. Every other
//! signal whose default would end the process (SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2,
//! SIGALRM, SIGXCPU, SIGXFSZ, SIGVTALRM, SIGPROF) interrupts: mflow stops its local stages,
//! leaves TrainJobs running for the next `mflow run` to reattach to, and records the run as
//! interrupted, because that is what a pod running mflow hears when it is evicted or drained,
//! and what a batch system sends when a limit is reached. A second signal of either kind kills
//! local stage processes at once. None of them ends mflow before its record is written.
//!
//! Once every stage has ended ([`AfterStages`]), a signal does not wait for what is left (the
//! `--report` file, the webhook): mflow ends as soon as its record is written (a second at
//! most), 130 or 143; a second signal ends it at once.
//!
//! A command that writes an output directory on its own ([`on_first`]) hears the same signals
//! with the same levels: the first removes what it was writing and ends it, 130 or 143.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mflow_contract::record::RunStatus;
use mflow_contract::ExitCode;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::{mpsc, watch};

use crate::backend::Cancel;

/// The signals that interrupt, besides SIGINT (which cancels).
const INTERRUPTING: [(libc::c_int, &str); 10] = [
    (libc::SIGTERM, "SIGTERM"),
    (libc::SIGHUP, "SIGHUP"),
    (libc::SIGQUIT, "SIGQUIT"),
    (libc::SIGUSR1, "SIGUSR1"),
    (libc::SIGUSR2, "SIGUSR2"),
    (libc::SIGALRM, "SIGALRM"),
    (libc::SIGXCPU, "SIGXCPU"),
    (libc::SIGXFSZ, "SIGXFSZ"),
    (libc::SIGVTALRM, "SIGVTALRM"),
    (libc::SIGPROF, "SIGPROF"),
];

/// A signal that arrived, with the cancel level it asks for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Caught {
    pub level: Cancel,
    pub name: &'static str,
    pub number: libc::c_int,
}

/// Every signal that stops mflow: SIGINT, which cancels, then those that interrupt.
fn stopping() -> impl Iterator<Item = (libc::c_int, &'static str)> {
    std::iter::once((libc::SIGINT, "SIGINT")).chain(INTERRUPTING)
}

/// Signals caught from the moment it is made until it is dropped, as they arrive.
struct Listening {
    rx: mpsc::UnboundedReceiver<Caught>,
    listeners: Vec<tokio::task::JoinHandle<()>>,
}

impl Listening {
    /// Catches `signals` now (their handlers are installed before this returns); needs a runtime.
    fn start(signals: impl Iterator<Item = (libc::c_int, &'static str)>) -> Listening {
        let (tx, rx) = mpsc::unbounded_channel::<Caught>();
        let mut listeners = vec![];
        for (number, name) in signals {
            // A signal that cannot be caught here is left at its default.
            let Ok(mut stream) = signal(SignalKind::from_raw(number)) else { continue };
            let level = if number == libc::SIGINT { Cancel::Graceful } else { Cancel::Detach };
            let tx = tx.clone();
            listeners.push(tokio::spawn(async move {
                while stream.recv().await.is_some() {
                    if tx.send(Caught { level, name, number }).is_err() {
                        return;
                    }
                }
            }));
        }
        Listening { rx, listeners }
    }

    async fn next(&mut self) -> Option<Caught> {
        self.rx.recv().await
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        for l in &self.listeners {
            l.abort();
        }
    }
}

/// Turns signals into cancel levels for every running attempt; returns after the second.
pub(super) async fn stop_on_signals(cancel: watch::Sender<Cancel>, interrupted: Arc<AtomicBool>) {
    let mut signals = Listening::start(stopping());
    for count in 1..=2 {
        let Some(Caught { level, name, .. }) = signals.next().await else { break };
        let (level, say) = match (count, level) {
            (1, Cancel::Detach) => (
                level,
                format!("interrupted ({name}): stopping local stages, leaving TrainJobs running (`mflow run` again reattaches)"),
            ),
            (1, _) => (level, "stopping: terminating running stages (Ctrl-C again to kill)".to_string()),
            _ => (Cancel::Immediate, format!("killing running stages ({name})")),
        };
        if count == 1 && level == Cancel::Detach {
            interrupted.store(true, Ordering::SeqCst);
        }
        say_once(&say);
        let _ = cancel.send(level);
    }
}

/// How long a signal after the stages waits for the run's record to be written.
const RECORD_WAIT: Duration = Duration::from_secs(1);

/// The exit code a signal of `level` gives (docs/exit-codes.md).
fn exit_code(level: Cancel) -> ExitCode {
    let status = if level == Cancel::Detach { RunStatus::Interrupted } else { RunStatus::Cancelled };
    ExitCode::for_ending(status, &[])
}

/// Signals once every stage has ended, heard on a thread of its own: the main thread may be
/// blocked (a webhook that does not answer, a report written into a FIFO). The first signal waits for
/// the run's record ([`AfterStages::recorded`]) a second at most, then ends the process, 130 or
/// 143; a second signal, or one after a signal during the stages, ends it at once. Dropped, it
/// stops listening.
pub struct AfterStages {
    recorded: watch::Sender<bool>,
}

impl AfterStages {
    /// Listens from now on; `earlier`: the level of a signal heard during the stages.
    pub(super) fn start(earlier: Option<Cancel>) -> AfterStages {
        let (recorded, rx) = watch::channel(false);
        if let Err(e) = listen_after(earlier, rx) {
            tracing::warn!("signals after the stages are not heard: {e}");
        }
        AfterStages { recorded }
    }

    /// The run's record is written: a signal need not wait for it.
    pub fn recorded(&self) {
        self.recorded.send_replace(true);
    }
}

fn listen_after(earlier: Option<Cancel>, mut recorded: watch::Receiver<bool>) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let mut signals = {
        let _in = rt.enter();
        Listening::start(stopping())
    };
    std::thread::Builder::new().name("mflow-signals".into()).spawn(move || {
        rt.block_on(async move {
            let dropped = async { while recorded.changed().await.is_ok() {} };
            let caught = tokio::select! {
                c = signals.next() => c,
                () = dropped => None,
            };
            let Some(Caught { level, name, .. }) = caught else { return };
            let Some(first) = earlier else {
                say_once(&format!("{name} after the stages ended: not waiting for the report or the webhook"));
                tokio::select! {
                    _ = recorded.wait_for(|r| *r) => {}
                    () = tokio::time::sleep(RECORD_WAIT) => {}
                    _ = signals.next() => {}
                }
                crate::exit::now(exit_code(level))
            };
            crate::exit::now(exit_code(first))
        })
    })?;
    Ok(())
}

/// For a command that runs no stages and writes an output (`mflow model`, `convert`, `export`,
/// `dataset`, `output --download`): the signals that stop `mflow run` are caught from now on,
/// with the same levels, and the first calls `stop` on a thread of its own while the command
/// goes on; `stop` ends the process. A signal the process was started ignoring (`nohup`, a
/// background job of a script) stays ignored.
pub(crate) fn on_first(stop: impl FnOnce(Caught) + Send + 'static) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let mut signals = {
        let _in = rt.enter();
        Listening::start(stopping().filter(|(number, _)| !ignored(*number)))
    };
    std::thread::Builder::new().name("mflow-signals".into()).spawn(move || {
        rt.block_on(async move {
            if let Some(caught) = signals.next().await {
                stop(caught);
            }
        })
    })?;
    Ok(())
}

/// Whether the signal's disposition is SIG_IGN.
fn ignored(number: libc::c_int) -> bool {
    // SAFETY: sigaction(2) with no new action only reads the current one into `old`.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    let read = unsafe { libc::sigaction(number, std::ptr::null(), &mut old) };
    read == 0 && old.sa_sigaction == libc::SIG_IGN
}

/// After a hangup the terminal is gone: a failed write keeps neither the stages from being
/// stopped nor the run from being recorded (`stdio`).
fn say_once(say: &str) {
    crate::errln!("mflow: {say}");
}
