//! Local processes. Each attempt runs in its own process group so that a cancel or timeout
//! reaches every process it started (torchrun's workers included).

use std::fs::File;
use std::io::Write;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::Command;
use tokio::sync::{mpsc, watch};

use super::{Cancel, Job, Line, Outcome};
use crate::exec::retry::FailureClass;

/// Time between SIGTERM and SIGKILL. `MFLOW_KILL_GRACE` (seconds) overrides it.
pub fn grace() -> Duration {
    std::env::var("MFLOW_KILL_GRACE").ok().and_then(|s| s.parse::<f64>().ok()).map(Duration::from_secs_f64).unwrap_or(Duration::from_secs(10))
}

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
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            let class = match e.kind() {
                std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied => FailureClass::User,
                _ => FailureClass::Infra,
            };
            return Outcome::Failed { class, message: format!("cannot start `{program}`: {e}") };
        }
    };
    let pgid = child.id().map(|p| p as i32);
    let readers = [
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
    let mut stopped: Option<FailureClass> = None;
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            _ = &mut timeout, if stopped.is_none() => {
                stopped = Some(FailureClass::Timeout);
                terminate(pgid, Cancel::Graceful, &mut child).await;
            }
            changed = cancel.changed(), if stopped.is_none() || *cancel.borrow() != Cancel::Immediate => {
                let level = if changed.is_ok() { *cancel.borrow() } else { Cancel::Immediate };
                if level != Cancel::None {
                    stopped = Some(FailureClass::Cancelled);
                    if level == Cancel::Immediate {
                        signal_group(pgid, libc::SIGKILL);
                    } else {
                        // Escalate while waiting for the grace period to end.
                        let mut c = cancel.clone();
                        let pg = pgid;
                        tokio::spawn(async move {
                            signal_group(pg, libc::SIGTERM);
                            tokio::select! {
                                _ = tokio::time::sleep(grace()) => {}
                                _ = async { let _ = c.wait_for(|l| *l == Cancel::Immediate).await; } => {}
                            }
                            signal_group(pg, libc::SIGKILL);
                        });
                    }
                }
            }
        }
    };
    // Whatever the main process left behind in its group goes too.
    signal_group(pgid, libc::SIGKILL);
    for r in readers {
        let _ = r.await;
    }
    if let Some(class) = stopped {
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
    classify(job, program, status)
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
fn classify(job: &Job, program: &str, status: std::process::ExitStatus) -> Outcome {
    use std::os::unix::process::ExitStatusExt;
    if let Some((class, message)) = read_status(&job.status_file) {
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
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
    let class = FailureClass::parse(v.get("class")?.as_str()?)?;
    let message = v.get("message").and_then(|m| m.as_str()).unwrap_or("the stage reported a failure").to_string();
    Some((class, message))
}

async fn terminate(pgid: Option<i32>, _level: Cancel, child: &mut tokio::process::Child) {
    signal_group(pgid, libc::SIGTERM);
    if tokio::time::timeout(grace(), child.wait()).await.is_err() {
        signal_group(pgid, libc::SIGKILL);
    }
}

fn signal_group(pgid: Option<i32>, sig: i32) {
    if let Some(pg) = pgid {
        // SAFETY: kill(2) with a negative pid signals a process group; no memory is touched.
        unsafe {
            libc::kill(-pg, sig);
        }
    }
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
