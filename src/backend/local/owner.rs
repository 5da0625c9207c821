//! mflow owns what its stages start. As the child subreaper of its processes it inherits every
//! process a stage orphans (double forks, daemons), so none leaves its tree. This module keeps
//! the steps that run, reaps the orphans that end, learns which step each process belongs to
//! while its ancestry can still be seen, and at the end of the run ends whatever is left.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::procfs::{self, Mark, Proc, Snapshot};
use super::sys::{self, Waitable};

/// What mflow knows of the processes of its steps.
pub struct Registry {
    /// The steps' main processes: tokio waits for them, so no one else may reap them.
    pub direct: BTreeSet<i32>,
    /// Running steps, by sequence number.
    pub live: BTreeMap<u64, Tracked>,
    pub subreaper: bool,
    /// Whether a step ever ran: a run that started none has nothing to sweep.
    pub started: bool,
}

pub struct Tracked {
    pub tag: String,
    pub main: i32,
    /// The main process is not yet waited for: its pid is still the step's.
    pub main_held: bool,
    /// The group may still exist: once gone its id may be reused, and it names nothing of the step.
    pub group_held: bool,
    pub mark: Mark,
    pub pipes: Vec<u64>,
    /// Processes seen in the step's tree, by pid and start: they stay the step's after they
    /// leave it without the tag (`env -i`, a new session, a double fork).
    pub known: BTreeSet<(i32, u64)>,
}

static REGISTRY: Mutex<Registry> =
    Mutex::new(Registry { direct: BTreeSet::new(), live: BTreeMap::new(), subreaper: false, started: false });

/// Taken around every spawn and every reap: a main process may end before its spawn returns,
/// and its zombie must not be reaped before it is known to be tokio's.
pub fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// How often the ancestry of running steps is looked at.
const LEARN: Duration = Duration::from_secs(1);
/// How soon to look again when the ended child first in line is not ours to reap.
const RETRY: Duration = Duration::from_millis(20);
/// How long the end of a run keeps killing what is left.
const SWEEP: Duration = Duration::from_secs(2);

impl Registry {
    /// The processes created since `mark`, reading nothing about the main processes of steps
    /// other than the one whose main process is `main`.
    pub fn snapshot(&self, mark: &Mark, main: i32) -> Snapshot {
        Snapshot::since(mark, &|pid| pid != main && self.direct.contains(&pid))
    }

    /// Whether mflow may reap `pid`: not a main process tokio waits for, and not in mflow's own
    /// group, where the children that other code of mflow spawns (and waits for) stay.
    fn reapable(&self, p: &Proc) -> bool {
        !self.direct.contains(&p.pid) && p.pgid != sys::own_group()
    }

    /// Reaps the orphans that have ended; false when a child someone else waits for stands
    /// first in line and hides the rest.
    fn reap_waitable(&self) -> bool {
        loop {
            match sys::peek() {
                Waitable::Child(pid) => match procfs::stat(pid) {
                    Some(p) if self.reapable(&p) && sys::reap(pid) => {}
                    _ => return false,
                },
                Waitable::None | Waitable::NoChildren => return true,
            }
        }
    }

    /// Reaps the ended orphans among `snap`.
    pub fn reap_in(&self, snap: &Snapshot) {
        let me = std::process::id() as i32;
        for p in snap.procs.values().filter(|p| p.zombie && p.ppid == me && self.reapable(p)) {
            sys::reap(p.pid);
        }
    }

    /// Records which processes each running step has now.
    fn learn(&mut self) {
        let Some(oldest) = self.live.values().map(|t| t.mark).min_by_key(|m| m.at) else { return };
        let snap = Snapshot::since(&oldest, &|pid| self.direct.contains(&pid));
        let seqs: Vec<u64> = self.live.keys().copied().collect();
        for seq in seqs {
            super::tree::members(self, seq, &snap, false, false);
        }
        self.reap_in(&snap);
    }

    /// Processes of this run that no running step claims.
    fn strays(&self, snap: &Snapshot) -> Vec<Proc> {
        let me = std::process::id() as i32;
        let own = sys::own_group();
        let live: BTreeSet<&str> = self.live.values().map(|t| t.tag.as_str()).collect();
        let prefix = format!("{me}.");
        let tagged = |p: &Proc| snap.tag(p.pid).is_some_and(|t| t.starts_with(&prefix) && !live.contains(t.as_str()));
        let below = |p: &Proc| {
            let Some(top) = snap.top(p.pid, me) else { return false };
            let theirs = self.direct.contains(&top.pid) || snap.tag(p.pid).is_some_and(|t| live.contains(t.as_str()));
            let foreign = top.pgid == own && snap.tag(top.pid).is_none();
            top.ppid == me && !theirs && !foreign
        };
        snap.procs
            .values()
            .filter(|p| p.pid != me && if self.subreaper { below(p) } else { tagged(p) })
            .cloned()
            .collect()
    }
}

/// Makes mflow the owner of every process its stages start, for as long as it is held: the
/// subreaper is set, ended orphans are reaped as they end, and dropping it ends what is left.
pub struct Owner {
    task: Option<tokio::task::JoinHandle<()>>,
}

/// Called once a run starts, inside its runtime.
pub fn own() -> Owner {
    {
        let mut reg = registry();
        if !reg.subreaper {
            reg.subreaper = *procfs::USABLE && sys::become_subreaper();
            if !reg.subreaper {
                tracing::debug!("not a subreaper: stage processes are found by their tag alone");
            }
        }
    }
    Owner { task: Some(tokio::spawn(reap_loop())) }
}

async fn reap_loop() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut chld = signal(SignalKind::child()).ok();
    let mut wait = LEARN;
    let mut learned = Instant::now();
    loop {
        tokio::select! {
            got = async { match &mut chld { Some(s) => s.recv().await, None => std::future::pending().await } } => {
                if got.is_none() {
                    chld = None;
                }
            }
            _ = tokio::time::sleep(wait) => {}
        }
        let mut reg = registry();
        wait = if reg.reap_waitable() { LEARN } else { RETRY };
        if learned.elapsed() >= LEARN && !reg.live.is_empty() {
            reg.learn();
            learned = Instant::now();
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
        sweep();
    }
}

/// Ends and reaps every process of the run that is left, whatever escaped its step.
fn sweep() {
    let deadline = Instant::now() + SWEEP;
    let mut reg = registry();
    if !reg.started {
        return;
    }
    loop {
        // With no child at all, nothing is left below mflow.
        if reg.subreaper && matches!(sys::peek(), Waitable::NoChildren) {
            return;
        }
        let snap = Snapshot::all(&|pid| reg.direct.contains(&pid));
        reg.reap_in(&snap);
        let left: Vec<Proc> = reg.strays(&snap).into_iter().filter(|p| !p.zombie).collect();
        if left.is_empty() {
            return;
        }
        for p in &left {
            let _ = sys::kill(p.pid, libc::SIGKILL);
        }
        if Instant::now() >= deadline {
            let pids: Vec<String> = left.iter().map(|p| format!("{} ({})", p.pid, p.name)).collect();
            tracing::warn!("could not end processes the run started: {}", pids.join(", "));
            return;
        }
        drop(reg);
        std::thread::sleep(Duration::from_millis(5));
        reg = registry();
    }
}
