//! What mflow reads about processes in /proc: each one's parent, group and start, the attempt
//! tag in its environment, and the pipes it holds.

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::os::fd::AsFd;
use std::sync::LazyLock;
use std::time::Instant;

use super::sys;

/// Every process of an attempt inherits this variable; mflow finds the attempt's processes by
/// it, whatever group or session they moved to.
pub const TAG_VAR: &str = "MFLOW_ATTEMPT_TAG";

/// Whether /proc shows this process under the pid it has: in a container with a foreign /proc
/// it does not, and nothing read there would be about mflow's processes.
pub static USABLE: LazyLock<bool> =
    LazyLock::new(|| read_stat("/proc/self/stat").is_some_and(|p| p.pid == std::process::id() as i32));

#[derive(Debug, Clone)]
pub struct Proc {
    pub pid: i32,
    pub ppid: i32,
    pub pgid: i32,
    /// Clock ticks after boot: with the pid, it names a process even after its pid is reused.
    pub start: u64,
    pub zombie: bool,
    pub name: String,
}

pub fn stat(pid: i32) -> Option<Proc> {
    read_stat(&format!("/proc/{pid}/stat"))
}

fn read_stat(path: &str) -> Option<Proc> {
    let text = std::fs::read_to_string(path).ok()?;
    // The name is in parentheses and may hold anything, parentheses and spaces included.
    let (open, close) = (text.find('(')?, text.rfind(')')?);
    let pid = text[..open].trim().parse().ok()?;
    let f: Vec<&str> = text[close + 1..].split_whitespace().collect();
    let num = |i: usize| f.get(i).and_then(|s| s.parse::<i64>().ok());
    Some(Proc {
        pid,
        ppid: num(1)? as i32,
        pgid: num(2)? as i32,
        start: num(19)? as u64,
        zombie: matches!(f.first(), Some(&"Z") | Some(&"X")),
        name: text[open + 1..close].to_string(),
    })
}

/// The value of the attempt tag in `pid`'s environment (as it was when it last exec'd).
pub fn tag(pid: i32) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let key = format!("{TAG_VAR}=");
    env.split(|&b| b == 0)
        .find_map(|kv| kv.strip_prefix(key.as_bytes()))
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// The inode of a pipe end mflow holds, by which other holders of the pipe are recognised.
pub fn pipe_inode(fd: &impl AsFd) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    let file = std::fs::File::from(fd.as_fd().try_clone_to_owned().ok()?);
    file.metadata().ok().map(|m| m.ino())
}

/// Whether `pid` holds one of the pipes `inodes` open.
pub fn holds_pipe(pid: i32, inodes: &[u64]) -> bool {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    dir.flatten().any(|e| {
        let link = std::fs::read_link(e.path()).unwrap_or_default();
        let link = link.to_string_lossy();
        link.strip_prefix("pipe:[")
            .and_then(|s| s.strip_suffix(']'))
            .and_then(|s| s.parse().ok())
            .is_some_and(|i| inodes.contains(&i))
    })
}

/// Where the pid counter stood when an attempt started. Processes created since have pids
/// after it, so looking at those few spares reading all of /proc, which cost 3 ms on a small
/// VM: at the end of every attempt of a 1000-stage run, that would double mflow's overhead.
#[derive(Debug, Clone, Copy)]
pub struct Mark {
    last: Option<i32>,
    pub at: Instant,
}

pub fn mark() -> Mark {
    Mark { last: last_pid(), at: Instant::now() }
}

/// Kept open: reading it through a held descriptor costs a tenth of opening it each time.
static LAST_PID: LazyLock<Option<std::fs::File>> =
    LazyLock::new(|| std::fs::File::open("/proc/sys/kernel/ns_last_pid").ok());

fn last_pid() -> Option<i32> {
    use std::os::unix::fs::FileExt;
    let mut buf = [0u8; 16];
    let n = LAST_PID.as_ref()?.read_at(&mut buf, 0).ok()?;
    std::str::from_utf8(&buf[..n]).ok()?.trim().parse().ok()
}

static PID_MAX: LazyLock<Option<i32>> =
    LazyLock::new(|| std::fs::read_to_string("/proc/sys/kernel/pid_max").ok()?.trim().parse().ok());

/// Found once: finding it reads the cgroup's files.
static CORES: LazyLock<f64> = LazyLock::new(|| std::thread::available_parallelism().map_or(1, |n| n.get()) as f64);

/// Pids a core can hand out per second, at most (a generous bound): a mark older than it takes
/// the machine to hand out every pid may have been passed by the counter unseen.
const FORKS_PER_CORE_SECOND: f64 = 25_000.0;

/// Beyond this many pids to probe, reading /proc whole is cheaper.
const MAX_PROBE: i32 = 2048;

/// The pids handed out since `mark` as (after, up to), or None where that cannot be told.
fn window(mark: &Mark, now: Option<i32>) -> Option<(i32, i32)> {
    let (from, to, max) = (mark.last?, now?, (*PID_MAX)?);
    let span = (to - from).rem_euclid(max);
    if span > MAX_PROBE || mark.at.elapsed().as_secs_f64() * FORKS_PER_CORE_SECOND * *CORES >= f64::from(max) {
        return None;
    }
    Some((from, to))
}

fn in_window((from, to): (i32, i32), pid: i32) -> bool {
    if from <= to {
        pid > from && pid <= to
    } else {
        pid > from || pid <= to
    }
}

/// One look at processes, shared by every question asked of it.
pub struct Snapshot {
    pub procs: HashMap<i32, Proc>,
    last: Option<i32>,
    tags: RefCell<HashMap<i32, Option<String>>>,
}

impl Snapshot {
    /// Processes created since `mark`, or every process where that cannot be told. `mains`
    /// are children of mflow it need not read about: main processes of other steps, whose
    /// trees only need to be told apart (reading a process's stat costs 25 us).
    pub fn since(mark: &Mark, mains: &dyn Fn(i32) -> bool) -> Snapshot {
        let last = last_pid();
        let pids = match window(mark, last) {
            Some((from, to)) => probe(from, to),
            None => all_pids(),
        };
        Snapshot::of(pids, last, mains)
    }

    pub fn all(mains: &dyn Fn(i32) -> bool) -> Snapshot {
        Snapshot::of(all_pids(), last_pid(), mains)
    }

    fn of(pids: Vec<i32>, last: Option<i32>, mains: &dyn Fn(i32) -> bool) -> Snapshot {
        let me = std::process::id() as i32;
        let known =
            |pid| mains(pid).then(|| Proc { pid, ppid: me, pgid: pid, start: 0, zombie: false, name: String::new() });
        let procs = pids.into_iter().filter_map(|pid| known(pid).or_else(|| stat(pid))).map(|p| (p.pid, p)).collect();
        Snapshot { procs, last, tags: RefCell::default() }
    }

    /// Whether `pid` was created after `mark`; None where that cannot be told.
    pub fn after(&self, mark: &Mark, pid: i32) -> Option<bool> {
        window(mark, self.last).map(|w| in_window(w, pid))
    }

    pub fn tag(&self, pid: i32) -> Option<String> {
        self.tags.borrow_mut().entry(pid).or_insert_with(|| tag(pid)).clone()
    }

    /// The oldest ancestor of `pid` in the snapshot below `me` (`pid` itself if its parent is
    /// not in it); for a process below mflow, the child of mflow it descends from.
    pub fn top(&self, pid: i32, me: i32) -> Option<&Proc> {
        let mut p = self.procs.get(&pid)?;
        // Bounded: pids reused while the snapshot was taken could make a loop.
        for _ in 0..self.procs.len() {
            match self.procs.get(&p.ppid) {
                Some(parent) if parent.pid != me => p = parent,
                _ => break,
            }
        }
        Some(p)
    }

    /// `seeds` and every process below one of them.
    pub fn below(&self, seeds: &BTreeSet<i32>, me: i32) -> BTreeSet<i32> {
        let mut out = BTreeSet::new();
        for &pid in self.procs.keys() {
            let mut cur = pid;
            for _ in 0..=self.procs.len() {
                if seeds.contains(&cur) {
                    out.insert(pid);
                    break;
                }
                match self.procs.get(&cur) {
                    Some(p) if p.ppid != me && p.ppid != cur => cur = p.ppid,
                    _ => break,
                }
            }
        }
        out
    }
}

/// The pids after `from` up to `to` that exist (wrapping around the pid counter's end).
fn probe(from: i32, to: i32) -> Vec<i32> {
    let max = PID_MAX.unwrap_or(i32::MAX);
    let mut out = Vec::new();
    let mut p = from;
    while p != to {
        p = if p + 1 >= max { 1 } else { p + 1 };
        if sys::exists(p) {
            out.push(p);
        }
    }
    out
}

fn all_pids() -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return vec![] };
    dir.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let me = stat(std::process::id() as i32).unwrap();
        assert_eq!(me.pid, std::process::id() as i32);
        assert!(!me.zombie);
        assert!(*USABLE);
    }

    #[test]
    fn a_window_wraps_around_the_counter() {
        assert!(in_window((10, 20), 15) && !in_window((10, 20), 10) && in_window((10, 20), 20));
        assert!(in_window((30000, 5), 31000) && in_window((30000, 5), 3) && !in_window((30000, 5), 100));
    }
}
