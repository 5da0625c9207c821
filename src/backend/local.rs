//! Local processes. Each step of an attempt runs in its own process group, and mflow owns
//! everything it starts: processes that leave the group (`setsid`, double forks, daemons) are
//! found by the tag they inherit and by ancestry below mflow, the subreaper of its stages
//! (`owner`). A timeout or cancel reaches all of them; when the main process ends, whatever
//! is left is killed, and the output pipes are read for a bounded time only.

mod output;
mod owner;
mod procfs;
mod sys;
mod tree;

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::process::Command;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use output::MAX_LINE;
pub use owner::{own as own_processes, Owner};

/// This process, as a run's record names it.
pub fn this_process() -> Option<mflow_contract::record::RunProcess> {
    let me = procfs::stat(std::process::id() as i32).filter(|_| *procfs::USABLE)?;
    Some(mflow_contract::record::RunProcess { host: host_name()?, pid: me.pid as u32, start: me.start })
}

/// Whether the process of a run record still runs: `None` when this machine cannot tell (another
/// host, no usable /proc).
pub fn still_runs(p: &mflow_contract::record::RunProcess) -> Option<bool> {
    if !*procfs::USABLE || host_name()? != p.host {
        return None;
    }
    Some(procfs::stat(p.pid as i32).is_some_and(|s| s.start == p.start && !s.zombie))
}

fn host_name() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    Some(name.trim().to_string()).filter(|n| !n.is_empty())
}
pub use procfs::TAG_VAR;

use output::{note, pump, Log};

use super::{Cancel, Job, Lines, Outcome};
use mflow_contract::FailureClass;

/// Time between SIGTERM and SIGKILL. `MFLOW_KILL_GRACE` (seconds) overrides it; the command
/// line checked it before anything ran.
pub fn grace() -> Duration {
    crate::settings::kill_grace().unwrap_or(Duration::from_secs(10))
}

/// How often a stopping step is looked at for processes still running.
const POLL: Duration = Duration::from_millis(50);

pub async fn run(job: &Job, lines: Lines, mut cancel: watch::Receiver<Cancel>) -> Outcome {
    let log = Arc::new(Mutex::new(Log::new(job.log.clone())));
    for argv in &job.steps {
        let outcome = run_step(job, argv, &log, &lines, &mut cancel).await;
        if outcome != Outcome::Success {
            return outcome;
        }
    }
    Outcome::Success
}

/// Why and when a step is being stopped.
#[derive(Default)]
struct Stop {
    class: Option<FailureClass>,
    /// When SIGKILL follows the SIGTERM.
    kill_at: Option<Instant>,
    killed: bool,
}

async fn run_step(
    job: &Job,
    argv: &[String],
    log: &Arc<Mutex<Log>>,
    lines: &Lines,
    cancel: &mut watch::Receiver<Cancel>,
) -> Outcome {
    if *cancel.borrow() != Cancel::None {
        return Outcome::Failed { class: FailureClass::Cancelled, message: "cancelled before start".into() };
    }
    let Some((program, args)) = argv.split_first() else {
        return Outcome::Failed { class: FailureClass::User, message: "empty command".into() };
    };
    let mut cmd = Command::new(find_program(program, job.env.get("PATH")));
    cmd.arg0(program)
        .args(args)
        .envs(&job.env)
        .current_dir(&job.cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let (mut tree, mut child) = match tree::Tree::spawn(&mut cmd) {
        Ok(c) => c,
        Err(e) => {
            // By the errno (docs/exit-codes.md): a NUL byte, an argument list or a path too long repeat.
            let class = FailureClass::of_io(&e);
            return Outcome::Failed { class, message: format!("cannot start `{program}`: {e}") };
        }
    };
    // Told when every process of the step is gone: the pipes are then read for a bounded time.
    let ended = CancellationToken::new();
    let pipe = |r: Box<dyn tokio::io::AsyncRead + Send + Unpin>| {
        tokio::spawn(pump(r, job.stage.clone(), job.attempt, log.clone(), lines.clone(), ended.clone()))
    };
    let readers =
        [pipe(Box::new(child.stdout.take().expect("piped"))), pipe(Box::new(child.stderr.take().expect("piped")))];
    let (status, stop) = supervise(job, &mut tree, &mut child, cancel).await;
    let left = tree.finish(&|| readers.iter().any(|r| !r.is_finished())).await;
    drop(tree);
    ended.cancel();
    drain(job, log, lines, readers).await;
    if stop.class.is_none() && !left.is_empty() {
        let names: Vec<String> = left.iter().take(5).map(|p| format!("`{}` (pid {})", p.name, p.pid)).collect();
        let more = if left.len() > 5 { format!(" and {} more", left.len() - 5) } else { String::new() };
        let n = left.len();
        let s = if n == 1 { "" } else { "es" };
        let text = format!("mflow: ended {n} process{s} the stage left running: {}{more}", names.join(", "));
        note(job, log, lines, text).await;
    }
    if let Some(class) = stop.class {
        let message = match class {
            FailureClass::Timeout => {
                format!("timed out after {}", humantime::format_duration(job.timeout.unwrap_or_default()))
            }
            _ => "cancelled".to_string(),
        };
        return Outcome::Failed { class, message };
    }
    let status = match status {
        Ok(s) => s,
        Err(e) => {
            return Outcome::Failed { class: FailureClass::of_io(&e), message: format!("waiting for `{program}`: {e}") }
        }
    };
    if status.success() {
        return Outcome::Success;
    }
    // The stage's own word, read off the runtime: its status file may be anything.
    let path = job.status_file.clone();
    let reported = crate::untrusted::blocking(move || read_status(&path)).await;
    classify(reported, program, status)
}

/// Waits for the step's main process, enforcing the timeout and the cancel level: SIGTERM, then
/// SIGKILL at the end of the grace period. What the main process left running has the rest of
/// the grace period.
async fn supervise(
    job: &Job,
    tree: &mut tree::Tree,
    child: &mut tokio::process::Child,
    cancel: &mut watch::Receiver<Cancel>,
) -> (std::io::Result<std::process::ExitStatus>, Stop) {
    let timeout = async {
        match job.timeout {
            Some(t) => tokio::time::sleep(t).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(timeout);
    let mut stop = Stop::default();
    let mut cancel_open = true;
    let status = loop {
        let kill_at = stop.kill_at;
        tokio::select! {
            status = child.wait() => break status,
            _ = &mut timeout, if stop.class.is_none() => {
                stop.class = Some(FailureClass::Timeout);
                stop.kill_at = Some(Instant::now() + grace());
                tree.signal(libc::SIGTERM);
            }
            changed = cancel.changed(), if cancel_open => {
                cancel_open = changed.is_ok();
                let level = *cancel.borrow();
                if level != Cancel::None {
                    // Detach stops local processes as Graceful does: nothing could reattach to them.
                    let first = stop.kill_at.is_none();
                    let at = Instant::now() + if level == Cancel::Immediate { Duration::ZERO } else { grace() };
                    stop.class = Some(FailureClass::Cancelled);
                    stop.kill_at = Some(kill_at.map_or(at, |k| k.min(at)));
                    if first && level != Cancel::Immediate {
                        tree.signal(libc::SIGTERM);
                    }
                }
            }
            _ = tokio::time::sleep_until(kill_at.unwrap_or_else(Instant::now)), if kill_at.is_some() && !stop.killed => {
                stop.killed = true;
                tree.signal(libc::SIGKILL);
            }
        }
    };
    tree.main_reaped();
    if let (Some(kill_at), false) = (stop.kill_at, stop.killed) {
        let mut c = cancel.clone();
        let immediate = async move {
            if c.wait_for(|l| *l == Cancel::Immediate).await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        tokio::pin!(immediate);
        while tree.alive() {
            tokio::select! {
                _ = tokio::time::sleep(POLL) => {}
                _ = tokio::time::sleep_until(kill_at) => break,
                _ = &mut immediate => break,
            }
        }
    }
    (status, stop)
}

/// Waits for the pipes' readers, which read what is left for a bounded time (`output::pump`)
/// and have sent every line they read when they end.
async fn drain(job: &Job, log: &Arc<Mutex<Log>>, lines: &Lines, readers: [tokio::task::JoinHandle<bool>; 2]) {
    let mut whole = true;
    for r in readers {
        whole &= r.await.unwrap_or(false);
    }
    if !whole {
        let text = "mflow: stopped reading the stage's output: a process mflow could not end still holds it open";
        note(job, log, lines, text.into()).await;
    }
}

/// `program` as found on the PATH the child gets, looked up once per run: spawning by name
/// tries every PATH entry before the right one, a failed exec each, for every stage. A name not
/// found stays as it is, so that spawning reports the error.
fn find_program(program: &str, path: Option<&String>) -> std::path::PathBuf {
    use std::collections::HashMap;
    use std::os::unix::fs::PermissionsExt;
    type Found = HashMap<(String, Option<String>), std::path::PathBuf>;
    static FOUND: std::sync::LazyLock<Mutex<Found>> = std::sync::LazyLock::new(Default::default);
    if program.contains('/') {
        return program.into();
    }
    let mut found = FOUND.lock().unwrap_or_else(|e| e.into_inner());
    found
        .entry((program.to_string(), path.cloned()))
        .or_insert_with(|| {
            let path = path.cloned().or_else(|| std::env::var("PATH").ok()).unwrap_or_default();
            for dir in std::env::split_paths(&path) {
                if !dir.is_absolute() {
                    break; // relative to the child's directory: the child's own search decides
                }
                let p = dir.join(program);
                if std::fs::metadata(&p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0) {
                    return p;
                }
            }
            program.into()
        })
        .clone()
}

/// The class a failed process gets: the stage's own word in its status file first, then the
/// way it ended.
fn classify(reported: Option<(FailureClass, String)>, program: &str, status: std::process::ExitStatus) -> Outcome {
    use std::os::unix::process::ExitStatusExt;
    if let Some((class, message)) = reported {
        return Outcome::Failed { class, message };
    }
    if let Some(sig) = status.signal() {
        let class = FailureClass::of_signal(sig);
        let why = match class {
            FailureClass::Oom => "killed by SIGKILL (likely out of memory)",
            FailureClass::Infra => "terminated by a signal from outside",
            _ => "crashed",
        };
        return Outcome::Failed { class, message: format!("`{program}` {why} (signal {sig})") };
    }
    let code = status.code().unwrap_or(-1);
    Outcome::Failed { class: FailureClass::User, message: format!("`{program}` exited with status {code}") }
}

/// Reads the class a stage reported for itself. `cancelled` is not a stage's to claim: only the
/// user cancels (exit 130), so such a report is ignored and the exit decides.
pub fn read_status(path: &std::path::Path) -> Option<(FailureClass, String)> {
    let v = crate::untrusted::read_json(path, crate::untrusted::SMALL_JSON)?;
    let class = FailureClass::parse(v.get("class")?.as_str()?).filter(|c| *c != FailureClass::Cancelled)?;
    // The stage's words, quoted by every message and record of the failure: an excerpt.
    let message = v.get("message").and_then(|m| m.as_str()).unwrap_or("the stage reported a failure");
    let message = crate::spec::error::excerpt_of(message, crate::spec::error::MAX_QUOTE);
    Some((class, message))
}
