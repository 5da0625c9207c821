//! Signals: what mflow does when it is asked to stop.
//!
//! Ctrl-C (SIGINT) cancels: running stages are stopped and their TrainJobs deleted. Every other
//! signal whose default would end the process (SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2,
//! SIGALRM, SIGXCPU, SIGXFSZ, SIGVTALRM, SIGPROF) interrupts: mflow stops its local stages,
//! leaves TrainJobs running for the next `mflow run` to reattach to, and records the run as
//! interrupted, because that is what a pod running mflow hears when it is evicted or drained,
//! and what a batch system sends when a limit is reached. A second signal of either kind kills
//! local stage processes at once. None of them ends mflow before its record is written.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

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

/// Turns signals into cancel levels for every running attempt; returns after the second.
pub(super) async fn stop_on_signals(cancel: watch::Sender<Cancel>, interrupted: Arc<AtomicBool>) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Cancel, &'static str)>();
    let mut listeners = vec![];
    let all = std::iter::once((libc::SIGINT, "SIGINT")).chain(INTERRUPTING);
    for (number, name) in all {
        // A signal that cannot be caught here is left at its default.
        let Ok(mut stream) = signal(SignalKind::from_raw(number)) else { continue };
        let level = if number == libc::SIGINT { Cancel::Graceful } else { Cancel::Detach };
        let tx = tx.clone();
        listeners.push(tokio::spawn(async move {
            while stream.recv().await.is_some() {
                if tx.send((level, name)).is_err() {
                    return;
                }
            }
        }));
    }
    drop(tx);
    for count in 1..=2 {
        let Some((level, name)) = rx.recv().await else { break };
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
    for l in listeners {
        l.abort();
    }
}

/// After a hangup the terminal is gone: a failed write keeps neither the stages from being
/// stopped nor the run from being recorded (`stdio`).
fn say_once(say: &str) {
    crate::errln!("mflow: {say}");
}
