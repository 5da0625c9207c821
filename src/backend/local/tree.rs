//! The processes of one step: its main process and group, and whatever left the group
//! (`setsid`, double forks, daemons). A process is the step's if it carries the step's tag,
//! is in its group, descends from its main process, was seen in its tree before, or holds its
//! output pipes; and, at the end of the step, if it is an orphan of mflow that no other running
//! step can have started.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

use super::owner::{registry, Registry, Tracked};
use super::procfs::{self, Mark, Proc, Snapshot, TAG_VAR};
use super::sys::{self, Waitable};

/// How long the end of a step keeps killing what it left before giving up on it.
const KILL_WAIT: Duration = Duration::from_secs(2);

pub struct Tree {
    seq: u64,
    main: i32,
    mark: Mark,
    done: bool,
}

static SEQ: AtomicU64 = AtomicU64::new(1);

impl Tree {
    /// Spawns a step's main process, tagged and registered.
    pub fn spawn(cmd: &mut Command) -> std::io::Result<(Tree, Child)> {
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let tag = format!("{}.{seq}", std::process::id());
        cmd.env(TAG_VAR, &tag);
        let mut reg = registry();
        let mark = procfs::mark();
        let child = cmd.spawn()?;
        let main = child.id().expect("a child not yet waited for has its pid") as i32;
        let pipes =
            [child.stdout.as_ref().and_then(procfs::pipe_inode), child.stderr.as_ref().and_then(procfs::pipe_inode)]
                .into_iter()
                .flatten()
                .collect();
        reg.direct.insert(main);
        reg.started = true;
        reg.live
            .insert(seq, Tracked { tag, main, main_held: true, group_held: true, mark, pipes, known: BTreeSet::new() });
        Ok((Tree { seq, main, mark, done: false }, child))
    }

    /// The main process was waited for: its pid is free again.
    pub fn main_reaped(&mut self) {
        let mut reg = registry();
        reg.direct.remove(&self.main);
        if let Some(t) = reg.live.get_mut(&self.seq) {
            t.main_held = false;
        }
    }

    /// Sends `sig` to the group while it exists; false once it is gone.
    fn signal_group(&self, reg: &mut Registry, sig: i32) -> bool {
        let Some(t) = reg.live.get_mut(&self.seq) else { return false };
        if t.group_held && sys::kill(-self.main, sig).is_err() {
            t.group_held = false;
        }
        t.group_held
    }

    /// Sends `sig` to every process of the step.
    pub fn signal(&mut self, sig: i32) {
        let mut reg = registry();
        let group = self.signal_group(&mut reg, sig);
        let snap = reg.snapshot(&self.mark, self.main);
        for p in members(&mut reg, self.seq, &snap, false, true) {
            // The group had it already.
            let had_it = group && p.pgid == self.main;
            if !had_it && !p.zombie {
                let _ = sys::kill(p.pid, sig);
            }
        }
    }

    /// Whether any process of the step is left (after the main process ended).
    pub fn alive(&mut self) -> bool {
        let mut reg = registry();
        if self.signal_group(&mut reg, 0) {
            return true;
        }
        let snap = reg.snapshot(&self.mark, self.main);
        members(&mut reg, self.seq, &snap, true, false).iter().any(|p| !p.zombie)
    }

    /// After the main process ended: kills and reaps whatever of the step is left; returns the
    /// processes that were still running. `pipes_open` says whether the output is still read.
    pub async fn finish(&mut self, pipes_open: &(dyn Fn() -> bool + Sync)) -> Vec<Proc> {
        let deadline = Instant::now() + KILL_WAIT;
        let mut ended: Vec<Proc> = Vec::new();
        loop {
            let (live, left) = self.kill_round(pipes_open());
            for p in &live {
                if !ended.iter().any(|e| e.pid == p.pid) {
                    ended.push(p.clone());
                }
            }
            if !left {
                break;
            }
            if Instant::now() >= deadline {
                let pids: Vec<String> = live.iter().map(|p| format!("{} ({})", p.pid, p.name)).collect();
                tracing::warn!("could not end every process of a stage: {}", pids.join(", "));
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.done = true;
        ended
    }

    /// SIGKILL to the group and every member, and reaps the members that ended. Returns the
    /// members that were running, and whether anything of the step is left.
    fn kill_round(&mut self, pipes_open: bool) -> (Vec<Proc>, bool) {
        let mut reg = registry();
        let group = self.signal_group(&mut reg, 0);
        // With no child at all, nothing of the step can be running anywhere below mflow.
        if reg.subreaper && !group && matches!(sys::peek(), Waitable::NoChildren) {
            return (vec![], false);
        }
        // Looked at before the group is killed, so that the members killed with it are told.
        let snap = reg.snapshot(&self.mark, self.main);
        let members = members(&mut reg, self.seq, &snap, true, pipes_open);
        if group {
            self.signal_group(&mut reg, libc::SIGKILL);
        }
        reg.reap_in(&snap);
        let main_held = reg.live.get(&self.seq).is_some_and(|t| t.main_held);
        let (mut live, mut left) = (Vec::new(), group);
        for p in members {
            if p.zombie {
                // Reaped above, or to be once its parent ends.
                left |= sys::exists(p.pid) && !(main_held && p.pid == self.main);
            } else {
                let _ = sys::kill(p.pid, libc::SIGKILL);
                left = true;
                live.push(p);
            }
        }
        (live, left)
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        // A step abandoned half-way: its processes go with it. Its main process, if still
        // running, is in its group or among the members.
        if !self.done {
            self.kill_round(false);
        }
        let mut reg = registry();
        if reg.live.remove(&self.seq).is_some_and(|t| !t.main_held) {
            reg.direct.remove(&self.main);
        }
    }
}

/// The processes of step `seq` among `snap`, remembered for later looks. `ending`: the step's
/// main process has ended, and orphans no other step can claim are this step's.
pub(super) fn members(reg: &mut Registry, seq: u64, snap: &Snapshot, ending: bool, pipes_open: bool) -> Vec<Proc> {
    let me = std::process::id() as i32;
    let own = sys::own_group();
    let Some(t) = reg.live.get(&seq) else { return vec![] };
    let named = |p: &Proc| {
        (t.main_held && p.pid == t.main) || (t.group_held && p.pgid == t.main) || t.known.contains(&(p.pid, p.start))
    };
    let mut seeds: BTreeSet<i32> = snap.procs.values().filter(|p| named(p)).map(|p| p.pid).collect();
    let found = snap.below(&seeds, me);
    for p in snap.procs.values() {
        if found.contains(&p.pid) || p.pid == me {
            continue;
        }
        let Some(top) = snap.top(p.pid, me) else { continue };
        // Not below mflow, or in another step's tree.
        if (reg.subreaper && top.ppid != me) || (top.pid != t.main && reg.direct.contains(&top.pid)) {
            continue;
        }
        match snap.tag(p.pid) {
            Some(tag) if tag == t.tag => {
                seeds.insert(p.pid);
            }
            Some(_) => {}
            None => {
                let holds = pipes_open && procfs::holds_pipe(p.pid, &t.pipes);
                let orphan =
                    ending && reg.subreaper && p.ppid == me && p.pgid != own && unclaimed(reg, seq, snap, p.pid);
                if holds || orphan {
                    seeds.insert(p.pid);
                }
            }
        }
    }
    let found = snap.below(&seeds, me);
    let procs: Vec<Proc> = found.iter().filter_map(|pid| snap.procs.get(pid).cloned()).collect();
    if let Some(t) = reg.live.get_mut(&seq) {
        t.known.extend(procs.iter().filter(|p| !p.zombie).map(|p| (p.pid, p.start)));
    }
    procs
}

/// Whether every other running step started after `pid` was created, so that none of them can
/// have started it.
fn unclaimed(reg: &Registry, seq: u64, snap: &Snapshot, pid: i32) -> bool {
    reg.live.iter().all(|(&s, other)| s == seq || snap.after(&other.mark, pid) == Some(false))
}
