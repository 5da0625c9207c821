//! Local processes. Each step of an attempt runs in its own process group, and mflow owns
//! everything it starts: processes that leave the group (`setsid`, double forks, daemons) are
//! found by the tag they inherit and by ancestry below mflow, the subreaper of its stages
//! (`owner`). A timeout or cancel reaches all of them; when the main process ends, whatever
//! is left is killed, and the output pipes are read for a bounded time only.

mod owner;
mod procfs;
mod sys;
mod tree;

use std::fs::File;
use std::io::Write;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::Command;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

pub use owner::{own as own_processes, Owner};
pub use procfs::TAG_VAR;

use super::{Cancel, Job, Line, Outcome};
use crate::exec::retry::FailureClass;

/// Time between SIGTERM and SIGKILL. `MFLOW_KILL_GRACE` (seconds) overrides it.
pub fn grace() -> Duration {
    std::env::var("MFLOW_KILL_GRACE").ok().and_then(|s| s.parse::<f64>().ok()).map(Duration::from_secs_f64).unwrap_or(Duration::from_secs(10))
}

/// How long the output is read after every process of a step is gone: a process mflow could
/// not end (another user's) may hold the pipes open for ever.
const DRAIN: Duration = Duration::from_secs(1);

/// How often a stopping step is looked at for processes still running.
const POLL: Duration = Duration::from_millis(50);

pub async fn run(job: &Job, lines: mpsc::UnboundedSender<Line>, mut cancel: watch::Receiver<Cancel>) -> Outcome {
    let log = Arc::new(Mutex::new(Log { path: job.log.clone(), file: None }));
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
    lines: &mpsc::UnboundedSender<Line>,
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
            let class = match e.kind() {
                std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied => FailureClass::User,
                _ => FailureClass::Infra,
            };
            return Outcome::Failed { class, message: format!("cannot start `{program}`: {e}") };
        }
    };
    let mut readers = [
        tokio::spawn(pump(child.stdout.take().expect("piped"), job.stage.clone(), log.clone(), lines.clone())),
        tokio::spawn(pump(child.stderr.take().expect("piped"), job.stage.clone(), log.clone(), lines.clone())),
    ];
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
    // What the main process left running when asked to stop has the rest of the grace period.
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
    let left = tree.finish(&|| readers.iter().any(|r| !r.is_finished())).await;
    drop(tree);
    let drained = tokio::time::timeout(DRAIN, async {
        for r in &mut readers {
            let _ = r.await;
        }
    })
    .await
    .is_ok();
    if !drained {
        for r in &readers {
            r.abort();
        }
        note(job, log, lines, "mflow: stopped reading the stage's output: a process mflow could not end still holds it open".into());
    }
    if stop.class.is_none() && !left.is_empty() {
        let names: Vec<String> = left.iter().take(5).map(|p| format!("`{}` (pid {})", p.name, p.pid)).collect();
        let more = if left.len() > 5 { format!(" and {} more", left.len() - 5) } else { String::new() };
        let n = left.len();
        note(job, log, lines, format!("mflow: ended {n} process{} the stage left running: {}{more}", if n == 1 { "" } else { "es" }, names.join(", ")));
    }
    if let Some(class) = stop.class {
        let message = match class {
            FailureClass::Timeout => format!("timed out after {}", humantime::format_duration(job.timeout.unwrap_or_default())),
            _ => "cancelled".to_string(),
        };
        return Outcome::Failed { class, message };
    }
    let status = match status {
        Ok(s) => s,
        Err(e) => return Outcome::Failed { class: FailureClass::Infra, message: format!("waiting for `{program}`: {e}") },
    };
    if status.success() {
        return Outcome::Success;
    }
    // The stage's own word, read off the runtime: its status file may be anything.
    let path = job.status_file.clone();
    let reported = crate::untrusted::blocking(move || read_status(&path)).await;
    classify(reported, program, status)
}

/// A line of mflow's own about the stage, in its log and on the console.
fn note(job: &Job, log: &Arc<Mutex<Log>>, lines: &mpsc::UnboundedSender<Line>, text: String) {
    if let Ok(mut f) = log.lock() {
        f.write(text.as_bytes());
    }
    let _ = lines.send(Line { stage: job.stage.clone(), text });
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
        let (class, why) = match sig {
            libc::SIGKILL => (FailureClass::Oom, "killed by SIGKILL (likely out of memory)"),
            libc::SIGTERM | libc::SIGHUP | libc::SIGINT => (FailureClass::Infra, "terminated by a signal from outside"),
            _ => (FailureClass::User, "crashed"),
        };
        return Outcome::Failed { class, message: format!("`{program}` {why} (signal {sig})") };
    }
    let code = status.code().unwrap_or(-1);
    Outcome::Failed { class: FailureClass::User, message: format!("`{program}` exited with status {code}") }
}

/// Reads the class a stage reported for itself.
pub fn read_status(path: &std::path::Path) -> Option<(FailureClass, String)> {
    let v = crate::untrusted::read_json(path, crate::untrusted::SMALL_JSON)?;
    let class = FailureClass::parse(v.get("class")?.as_str()?)?;
    let message = v.get("message").and_then(|m| m.as_str()).unwrap_or("the stage reported a failure").to_string();
    Some((class, message))
}

/// The attempt's log, created with its directory at the first line: a stage that prints nothing
/// costs no files.
pub struct Log {
    path: std::path::PathBuf,
    file: Option<File>,
}

impl Log {
    fn write(&mut self, line: &[u8]) {
        if self.file.is_none() {
            if let Some(dir) = self.path.parent() {
                let _ = std::fs::create_dir_all(dir);
            }
            self.file = File::create(&self.path).ok();
        }
        if let Some(f) = &mut self.file {
            let _ = f.write_all(line);
            if !line.ends_with(b"\n") {
                let _ = f.write_all(b"\n");
            }
        }
    }
}

async fn pump<R: AsyncRead + Unpin>(r: R, stage: String, log: Arc<Mutex<Log>>, lines: mpsc::UnboundedSender<Line>) {
    let mut reader = BufReader::new(r);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                if let Ok(mut f) = log.lock() {
                    f.write(&buf);
                }
                let text = String::from_utf8_lossy(&buf).trim_end_matches(['\n', '\r']).to_string();
                let _ = lines.send(Line { stage: stage.clone(), text });
            }
        }
    }
}
