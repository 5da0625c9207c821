//! mflow owns everything a stage starts. Processes that leave the stage's process group
//! (`setsid`, double forks, daemons, `env -i`) are ended on timeout, on every signal and at the
//! end of the attempt, none of them keeps mflow waiting on its output pipes, and none is left
//! running when mflow exits. Through the real binary; each test checks /proc for processes
//! carrying the attempt tag of its mflow, and the pids its stages wrote down.

mod common;

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::Project;

/// A one-stage (or more) spec; `{dir}` in a script is the project's directory.
struct Case {
    p: Project,
}

impl Case {
    fn new(stages: &[(&str, &str, &str)]) -> Case {
        let p = Project::new("");
        std::fs::create_dir_all(p.file("pids")).unwrap();
        let dir = p.path().display().to_string();
        let mut spec = String::from("[pipeline]\nname = \"procs\"\n");
        for (name, extra, script) in stages {
            let script = script.replace("{dir}", &dir);
            assert!(!script.contains("'''"));
            spec += &format!("[stages.{name}]\nkind = \"command\"\n{extra}\nrun = [\"sh\", \"-c\", '''{script}''']\n");
        }
        p.write_spec(&spec);
        Case { p }
    }

    fn start(&self, env: &[(&str, &str)]) -> Running {
        let mut cmd = self.p.cmd(&["run", "spec.toml"]);
        cmd.envs(env.iter().copied()).stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let mut err = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        Running { pid: child.id() as i32, child, stderr: Some(stderr), dir: self.p.path().to_path_buf(), seen: vec![] }
    }

    fn record(&self) -> serde_json::Value {
        self.p.latest_record()
    }

    fn staging_left(&self) -> usize {
        std::fs::read_dir(self.p.file(".mflow/cache/.staging")).map(|d| d.count()).unwrap_or(0)
    }

    fn log(&self, stage: &str) -> String {
        let r = self.record();
        let runs = self.p.file(".mflow/runs").join(r["id"].as_str().unwrap());
        std::fs::read_to_string(runs.join("stages").join(stage).join("attempt-1.log")).unwrap_or_default()
    }
}

/// A running `mflow run`, with what it takes to check that it left nothing behind.
struct Running {
    pid: i32,
    child: Child,
    stderr: Option<std::thread::JoinHandle<String>>,
    /// The project: the stages' working directory, with the pid files under `pids/`.
    dir: PathBuf,
    /// Processes the stages wrote down: pid, start time (pids get reused), name of the file.
    seen: Vec<(i32, u64, String)>,
}

impl Running {
    /// Waits until the stage wrote the pid file `name`, and remembers that process.
    fn pid(&mut self, name: &str) -> i32 {
        let path = self.dir.join("pids").join(name);
        let t = Instant::now();
        loop {
            if let Some(pid) =
                std::fs::read_to_string(&path).ok().filter(|s| s.ends_with('\n')).and_then(|s| s.trim().parse().ok())
            {
                let start = stat(pid).map(|s| s.start).unwrap_or(0);
                self.seen.push((pid, start, name.to_string()));
                return pid;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "the stage never wrote {name}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn signal(&self, sig: i32) {
        // SAFETY: signals the mflow process this test started.
        unsafe { libc::kill(self.pid, sig) };
    }

    /// Waits for mflow to exit, at most `limit`; returns its status, how long it took from
    /// `since`, and its stderr.
    fn exit_within(&mut self, limit: Duration, since: Instant) -> (ExitStatus, Duration, String) {
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                let took = since.elapsed();
                let err = self.stderr.take().unwrap().join().unwrap();
                return (status, took, err);
            }
            if since.elapsed() > limit {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("mflow did not exit within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Processes of this mflow (its attempt tag) or written down by its stages, still running.
    fn survivors(&self) -> Vec<String> {
        let mut out: Vec<String> =
            tagged(self.pid).into_iter().map(|(pid, name)| format!("{pid} {name} (tagged)")).collect();
        for (pid, start, file) in &self.seen {
            if stat(*pid).is_some_and(|s| s.start == *start && !s.zombie) {
                out.push(format!("{pid} ({file})"));
            }
        }
        out
    }

    /// Asserts that nothing of the run is left, a moment after mflow exited.
    fn assert_nothing_left(&self) {
        let t = Instant::now();
        let mut left = self.survivors();
        // SIGKILL is asynchronous: a process may take a moment to go.
        while !left.is_empty() && t.elapsed() < Duration::from_millis(300) {
            std::thread::sleep(Duration::from_millis(20));
            left = self.survivors();
        }
        assert!(left.is_empty(), "processes of the run survived mflow: {left:?}");
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // Whatever a failing test leaves is not left to the next one.
        let _ = self.child.kill();
        let _ = self.child.wait();
        for (pid, _) in tagged(self.pid) {
            kill(pid);
        }
        for (pid, start, _) in &self.seen {
            if stat(*pid).is_some_and(|s| s.start == *start) {
                kill(*pid);
            }
        }
        // Untagged ones that were not written down: by their working directory.
        for pid in pids() {
            if std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|d| d.starts_with(&self.dir)) {
                kill(pid);
            }
        }
    }
}

fn pids() -> Vec<i32> {
    std::fs::read_dir("/proc").unwrap().flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect()
}

fn kill(pid: i32) {
    // SAFETY: kills a process that this test's stages started (checked by tag or start time).
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

struct Stat {
    ppid: i32,
    sid: i32,
    start: u64,
    zombie: bool,
}

fn stat(pid: i32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let f: Vec<&str> = text[text.rfind(')')? + 1..].split_whitespace().collect();
    Some(Stat { ppid: f[1].parse().ok()?, sid: f[3].parse().ok()?, start: f[19].parse().ok()?, zombie: f[0] == "Z" })
}

/// Running processes whose environment carries an attempt tag of mflow `mflow`.
fn tagged(mflow: i32) -> Vec<(i32, String)> {
    let prefix = format!("MFLOW_ATTEMPT_TAG={mflow}.");
    let mut out = vec![];
    for pid in pids() {
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else { continue };
        if env.split(|&b| b == 0).any(|kv| kv.starts_with(prefix.as_bytes())) && stat(pid).is_some_and(|s| !s.zombie) {
            let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            out.push((pid, name.trim().to_string()));
        }
    }
    out
}

fn session_of_self() -> i32 {
    stat(std::process::id() as i32).unwrap().sid
}

const FAST: Duration = Duration::from_secs(5);

// ---- the attempt ends normally: what it left is ended, and mflow does not wait for it ----

/// Runs `script` as stage `s`, expects success within `FAST`, and returns the case, the run
/// and how long it took.
fn succeeds(script: &str, files: &[&str]) -> (Case, Running, Duration) {
    let c = Case::new(&[("s", "", script)]);
    let mut r = c.start(&[]);
    let t = Instant::now();
    for f in files {
        r.pid(f);
    }
    let (status, took, err) = r.exit_within(FAST, t);
    assert_eq!(status.code(), Some(0), "{err}");
    assert_eq!(c.record()["status"], "succeeded");
    assert_eq!(c.record()["stages"]["s"]["status"], "succeeded");
    eprintln!("exited {took:?} after start");
    r.assert_nothing_left();
    (c, r, took)
}

#[test]
fn a_double_fork_holding_the_pipe_is_ended_with_the_attempt() {
    let (c, _r, _) = succeeds("(sleep 1000 & echo $! > {dir}/pids/orphan); echo ok > $MFLOW_OUTPUT/ok", &["orphan"]);
    assert!(c.log("s").contains("ended 1 process the stage left running"), "{}", c.log("s"));
}

#[test]
fn a_setsid_child_holding_the_pipe_does_not_hold_mflow() {
    let script = "setsid sleep 1000 & echo $! > {dir}/pids/escaped; sleep 0.3; echo ok > $MFLOW_OUTPUT/ok";
    let c = Case::new(&[("s", "", script)]);
    let mut r = c.start(&[]);
    let t = Instant::now();
    let pid = r.pid("escaped");
    std::thread::sleep(Duration::from_millis(100));
    assert_ne!(stat(pid).unwrap().sid, session_of_self(), "the child did not leave the session");
    let (status, took, err) = r.exit_within(FAST, t);
    assert_eq!(status.code(), Some(0), "{err}");
    eprintln!("exited {took:?} after start");
    r.assert_nothing_left();
}

#[test]
fn a_daemon_that_closed_its_output_is_ended_before_the_next_stage() {
    // The downstream stage fails if the daemon is still there when it starts.
    let daemon = r#"setsid sh -c 'exec >/dev/null 2>&1 </dev/null; sleep 1000' & echo $! > {dir}/pids/daemon; sleep 0.2; echo ok > $MFLOW_OUTPUT/ok"#;
    let check = "if kill -0 $(cat {dir}/pids/daemon) 2>/dev/null; then echo still running; exit 1; fi; echo ok > $MFLOW_OUTPUT/ok";
    let c = Case::new(&[("a", "", daemon), ("b", "needs = [\"a\"]", check)]);
    let mut r = c.start(&[]);
    let t = Instant::now();
    r.pid("daemon");
    let (status, took, err) = r.exit_within(FAST, t);
    assert_eq!(status.code(), Some(0), "{err}\n{}", c.log("b"));
    assert_eq!(c.record()["stages"]["b"]["status"], "succeeded");
    eprintln!("exited {took:?} after start");
    r.assert_nothing_left();
}

#[test]
fn a_daemon_without_the_tag_or_the_pipes_is_ended_before_the_next_stage() {
    // `env -i` drops the tag, the redirections the pipes, setsid the group and the session, and
    // the double fork the parent: only being mflow's orphan is left to tell it apart.
    let daemon = r#"(setsid env -i sh -c 'exec >/dev/null 2>&1 </dev/null; sleep 1000' & echo $! > {dir}/pids/daemon); sleep 0.2; echo ok > $MFLOW_OUTPUT/ok"#;
    let check = "if kill -0 $(cat {dir}/pids/daemon) 2>/dev/null; then echo still running; exit 1; fi; echo ok > $MFLOW_OUTPUT/ok";
    let c = Case::new(&[("a", "", daemon), ("b", "needs = [\"a\"]", check)]);
    let mut r = c.start(&[]);
    let t = Instant::now();
    r.pid("daemon");
    let (status, took, err) = r.exit_within(FAST, t);
    assert_eq!(status.code(), Some(0), "{err}\n{}", c.log("b"));
    eprintln!("exited {took:?} after start");
    r.assert_nothing_left();
}

#[test]
fn grandchildren_that_keep_the_pipe_open_are_ended() {
    let script = r#"sh -c 'sleep 1000' & echo $! > {dir}/pids/inside; setsid sh -c 'sh -c "sleep 1000; echo late"' & echo $! > {dir}/pids/outside; sleep 0.2; echo ok > $MFLOW_OUTPUT/ok"#;
    succeeds(script, &["inside", "outside"]);
}

#[test]
fn a_main_process_that_succeeds_while_a_descendant_writes_on() {
    let script = r#"setsid sh -c 'while :; do echo tick; sleep 0.02; done' & echo $! > {dir}/pids/writer; sleep 0.3; echo ok > $MFLOW_OUTPUT/ok"#;
    let (c, _r, _) = succeeds(script, &["writer"]);
    let log = c.log("s");
    assert!(log.contains("tick"), "{log}");
    assert!(log.contains("the stage left running: `sh`"), "{log}");
}

#[test]
fn an_orphan_that_ends_later_is_reaped_not_left_a_zombie() {
    let script = "(setsid sleep 0.5 & echo $! > {dir}/pids/late); sleep 2.5; echo ok > $MFLOW_OUTPUT/ok";
    let c = Case::new(&[("s", "", script)]);
    let mut r = c.start(&[]);
    let t = Instant::now();
    let pid = r.pid("late");
    // It re-parents to mflow, the subreaper, rather than to init...
    let seen = Instant::now();
    while stat(pid).is_some_and(|s| s.ppid != r.pid) && seen.elapsed() < Duration::from_millis(400) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(stat(pid).map(|s| s.ppid), Some(r.pid), "the orphan did not re-parent to mflow");
    // ...and once it ends, mflow reaps it while the stage still runs.
    std::thread::sleep(Duration::from_millis(1200));
    assert!(stat(pid).is_none(), "the orphan is left a zombie of mflow");
    let (status, _, err) = r.exit_within(FAST, t);
    assert_eq!(status.code(), Some(0), "{err}");
    r.assert_nothing_left();
}

// ---- the attempt is stopped: timeout and signals reach what escaped ----

/// A stage whose processes ignore SIGTERM (the ignored disposition is inherited), with one
/// escaped into its own session; the main process waits for ever.
const STUBBORN: &str = r#"trap '' TERM; setsid sleep 1000 & echo $! > {dir}/pids/escaped; sh -c 'sleep 1000' & echo $! > {dir}/pids/child; wait"#;
/// Stops on SIGTERM, but has escaped into its own session.
const ESCAPED: &str = "setsid sleep 1000 & echo $! > {dir}/pids/escaped; sleep 1000 & echo $! > {dir}/pids/child; wait";

/// Starts `script` as stage `s` and returns once its processes are up.
fn started(script: &str, extra: &str, env: &[(&str, &str)]) -> (Case, Running) {
    let c = Case::new(&[("s", extra, script)]);
    let mut r = c.start(env);
    r.pid("escaped");
    r.pid("child");
    std::thread::sleep(Duration::from_millis(100));
    (c, r)
}

fn assert_stopped(c: &Case, r: &mut Running, since: Instant, limit: Duration, code: i32, status: &str) -> Duration {
    let (exit, took, err) = r.exit_within(limit, since);
    assert_eq!(exit.code(), Some(code), "{err}");
    let rec = c.record();
    assert_eq!(rec["status"], status, "{rec}");
    assert_eq!(c.staging_left(), 0, "a partial entry was left in staging");
    assert!(c.p.cache_keys().is_empty(), "a stopped stage was committed");
    r.assert_nothing_left();
    took
}

#[test]
fn the_timeout_ends_escaped_processes_that_ignore_sigterm() {
    let c = Case::new(&[("s", "timeout = \"1s\"", STUBBORN)]);
    let mut r = c.start(&[]);
    let t = Instant::now();
    r.pid("escaped");
    // 1 s of timeout, 1 s of grace (MFLOW_KILL_GRACE), then SIGKILL.
    let took = assert_stopped(&c, &mut r, t, Duration::from_secs(6), 3, "failed");
    let stage = &c.record()["stages"]["s"];
    assert!(stage["message"].as_str().unwrap().contains("timed out after 1s"), "{stage}");
    assert!(took >= Duration::from_secs(2), "SIGKILL came before the grace period ended: {took:?}");
    eprintln!("exited {took:?} after start (timeout 1s, grace 1s)");
}

#[test]
fn a_setsid_escapee_under_a_timeout_neither_hangs_mflow_nor_outlives_the_stage() {
    // The trial's case: the main process is gone at once, its escaped child holds the pipes.
    let c = Case::new(&[(
        "s",
        "timeout = \"1s\"",
        "setsid sleep 1000 & echo $! > {dir}/pids/escaped; sleep 0.2; echo ok > $MFLOW_OUTPUT/ok",
    )]);
    let mut r = c.start(&[]);
    let t = Instant::now();
    r.pid("escaped");
    let (status, took, err) = r.exit_within(FAST, t);
    assert_eq!(status.code(), Some(0), "{err}");
    eprintln!("exited {took:?} after start");
    r.assert_nothing_left();
}

#[test]
fn one_sigint_terminates_then_kills_after_the_grace_period() {
    let (c, mut r) = started(STUBBORN, "", &[]);
    let t = Instant::now();
    r.signal(libc::SIGINT);
    let took = assert_stopped(&c, &mut r, t, FAST, 130, "cancelled");
    assert_eq!(c.record()["stages"]["s"]["status"], "cancelled");
    eprintln!("exited {took:?} after SIGINT (grace 1s)");
}

#[test]
fn a_second_sigint_kills_at_once() {
    let (c, mut r) = started(STUBBORN, "", &[("MFLOW_KILL_GRACE", "60")]);
    r.signal(libc::SIGINT);
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    r.signal(libc::SIGINT);
    let took = assert_stopped(&c, &mut r, t, Duration::from_secs(3), 130, "cancelled");
    eprintln!("exited {took:?} after the second SIGINT (grace 60s)");
}

#[test]
fn sigterm_stops_escaped_processes_and_records_interrupted() {
    let (c, mut r) = started(ESCAPED, "", &[("MFLOW_KILL_GRACE", "60")]);
    let t = Instant::now();
    r.signal(libc::SIGTERM);
    // Everything goes on SIGTERM: no grace period is waited out.
    let took = assert_stopped(&c, &mut r, t, Duration::from_secs(3), 143, "interrupted");
    eprintln!("exited {took:?} after SIGTERM");
}

#[test]
fn a_second_sigterm_kills_what_ignores_the_first() {
    let (c, mut r) = started(STUBBORN, "", &[("MFLOW_KILL_GRACE", "60")]);
    r.signal(libc::SIGTERM);
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    r.signal(libc::SIGTERM);
    let took = assert_stopped(&c, &mut r, t, Duration::from_secs(3), 143, "interrupted");
    eprintln!("exited {took:?} after the second SIGTERM (grace 60s)");
}

#[test]
fn sighup_is_handled_as_sigterm() {
    let (c, mut r) = started(ESCAPED, "", &[("MFLOW_KILL_GRACE", "60")]);
    let t = Instant::now();
    r.signal(libc::SIGHUP);
    let took = assert_stopped(&c, &mut r, t, Duration::from_secs(3), 143, "interrupted");
    assert_eq!(c.record()["stages"]["s"]["status"], "cancelled");
    eprintln!("exited {took:?} after SIGHUP");
}

/// Every other signal whose default would end mflow (Ctrl-\\ at a terminal, a batch system's
/// limits, a user's `kill -USR1`) interrupts as SIGTERM does: the record is written and no stage
/// process is left.
#[test]
fn every_catchable_signal_that_would_end_mflow_interrupts_and_records() {
    for sig in [
        libc::SIGQUIT,
        libc::SIGUSR1,
        libc::SIGUSR2,
        libc::SIGALRM,
        libc::SIGXCPU,
        libc::SIGXFSZ,
        libc::SIGVTALRM,
        libc::SIGPROF,
    ] {
        let (c, mut r) = started(ESCAPED, "", &[("MFLOW_KILL_GRACE", "60")]);
        let t = Instant::now();
        r.signal(sig);
        let took = assert_stopped(&c, &mut r, t, Duration::from_secs(5), 143, "interrupted");
        eprintln!("signal {sig}: exited {took:?} after it");
    }
}

/// An environment setting that mflow cannot use is refused before anything runs, naming the
/// variable, as a value of the spec would be: never a panic later, never silently ignored.
#[test]
fn bad_settings_in_the_environment_are_refused_naming_the_variable() {
    let c = Case::new(&[("s", "", "echo ok > $MFLOW_OUTPUT/ok")]);
    for (var, value) in [
        ("MFLOW_KILL_GRACE", "-5"),
        ("MFLOW_KILL_GRACE", "1e300"),
        ("MFLOW_KILL_GRACE", "soon"),
        ("MFLOW_UPLOAD_MAX_BYTES", "2GB"),
        ("MFLOW_DOWNLOAD_MAX_BYTES", "0"),
        ("MFLOW_HUB_MAX_FILE_BYTES", "-1"),
        ("MFLOW_MEMORY_BUDGET", "lots"),
    ] {
        let o = c.p.cmd(&["run", "spec.toml"]).env(var, value).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert_eq!(o.status.code(), Some(2), "{var}={value}: {err}");
        assert!(err.contains(&format!("{var}={value}")) && err.contains("mflow::settings::invalid"), "{err}");
        assert!(!c.p.file(".mflow/runs").exists(), "{var}={value}: a run started");
    }
    let o = c.p.cmd(&["run", "spec.toml"]).env("MFLOW_KILL_GRACE", "2.5").output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
}

/// SIGKILL cannot be caught: the record stays `running`, and `mflow runs` and `mflow status`
/// say that its process is gone.
#[test]
fn a_run_whose_process_was_killed_reads_as_gone() {
    let (c, mut r) = started(ESCAPED, "", &[]);
    let t = Instant::now();
    r.signal(libc::SIGKILL);
    let (status, _, _) = r.exit_within(Duration::from_secs(5), t);
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(libc::SIGKILL));
    assert_eq!(c.record()["status"], "running");
    let runs = c.p.mflow(&["runs"]);
    let out = String::from_utf8_lossy(&runs.stdout).to_string();
    assert!(out.contains(" gone "), "{out}");
    let status = c.p.mflow(&["status"]);
    assert!(String::from_utf8_lossy(&status.stdout).contains(") gone"));
    assert!(String::from_utf8_lossy(&status.stderr).contains("is gone without ending the run"));
    let json = c.p.mflow(&["runs", "--output-format", "json"]);
    assert!(String::from_utf8_lossy(&json.stdout).contains("\"process_gone\":true"));
}

#[test]
fn sighup_after_the_terminal_closed_still_stops_and_records() {
    // mflow writes to a terminal that is gone, as after a closed ssh session: every write fails.
    let (master, slave) = pty();
    let c = Case::new(&[("s", "", ESCAPED)]);
    let mut cmd = c.p.cmd(&["run", "spec.toml"]);
    cmd.stdin(Stdio::null()).stdout(slave.try_clone().unwrap()).stderr(slave).process_group(0);
    let child = cmd.spawn().unwrap();
    let mut r = Running {
        pid: child.id() as i32,
        child,
        stderr: Some(std::thread::spawn(String::new)),
        dir: c.p.path().to_path_buf(),
        seen: vec![],
    };
    r.pid("escaped");
    r.pid("child");
    drop(master);
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    r.signal(libc::SIGHUP);
    let took = assert_stopped(&c, &mut r, t, Duration::from_secs(3), 143, "interrupted");
    eprintln!("exited {took:?} after SIGHUP with the terminal gone");
}

/// A pseudo-terminal: (master, slave).
fn pty() -> (std::fs::File, std::fs::File) {
    use std::os::fd::FromRawFd;
    // SAFETY: posix_openpt returns a new descriptor (or -1), owned by the File from here on.
    let master = unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY) };
    assert!(master >= 0);
    // SAFETY: `master` is the open master just made.
    let master = unsafe {
        assert_eq!(libc::grantpt(master), 0);
        assert_eq!(libc::unlockpt(master), 0);
        std::fs::File::from_raw_fd(master)
    };
    let mut name = [0 as libc::c_char; 128];
    use std::os::fd::AsRawFd;
    // SAFETY: ptsname_r writes at most `name.len()` bytes into `name`.
    assert_eq!(unsafe { libc::ptsname_r(master.as_raw_fd(), name.as_mut_ptr(), name.len()) }, 0);
    // SAFETY: ptsname_r wrote a NUL-terminated path.
    let path = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
    let slave = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    (master, slave)
}

// ---- many attempts ----

#[test]
fn parallel_stages_each_end_only_their_own() {
    // Two stages at once, each leaving an untagged daemon. When `a` ends, `b`'s daemon (which
    // `a` cannot be told from by tag, pipe or session) is left alone: `b` checks it at its end.
    let leave = |n: &str| {
        format!(r#"(setsid env -i sh -c 'exec >/dev/null 2>&1 </dev/null; sleep 1000' & echo $! > {{dir}}/pids/{n})"#)
    };
    let a = format!("{}; sleep 0.3; echo ok > $MFLOW_OUTPUT/ok", leave("a"));
    let b = format!("{}; sleep 1.5; kill -0 $(cat {{dir}}/pids/b) || exit 1; echo ok > $MFLOW_OUTPUT/ok", leave("b"));
    let c = Case::new(&[("a", "", &a), ("b", "", &b)]);
    let mut r = c.start(&[]);
    let t = Instant::now();
    r.pid("a");
    r.pid("b");
    let (status, took, err) = r.exit_within(FAST, t);
    assert_eq!(status.code(), Some(0), "{err}\n{}", c.log("b"));
    assert_eq!(c.record()["stages"]["a"]["status"], "succeeded");
    assert_eq!(c.record()["stages"]["b"]["status"], "succeeded");
    eprintln!("exited {took:?} after start");
    r.assert_nothing_left();
}

#[test]
fn an_untagged_daemon_seen_in_its_stage_is_ended_with_it_while_another_stage_runs() {
    // `a` starts, without the tag, a daemon whose parent stays in `a`'s tree for 2 s, long
    // enough for mflow to see it there; then the parent goes and the daemon is an orphan that
    // `b`, running alongside, could also have started. `a`'s end must take it all the same:
    // `b` checks after `a` ended.
    let a = r#"env -i sh -c 'setsid sh -c "exec >/dev/null 2>&1 </dev/null; sleep 1000" & echo $! > {dir}/pids/a; sleep 2'; echo ok > $MFLOW_OUTPUT/ok"#;
    let b = "sleep 3.2; if kill -0 $(cat {dir}/pids/a) 2>/dev/null; then echo still running; exit 1; fi; echo ok > $MFLOW_OUTPUT/ok";
    let c = Case::new(&[("a", "", a), ("b", "", b)]);
    let mut r = c.start(&[]);
    let t = Instant::now();
    r.pid("a");
    let (status, took, err) = r.exit_within(Duration::from_secs(8), t);
    assert_eq!(status.code(), Some(0), "{err}\n{}", c.log("b"));
    eprintln!("exited {took:?} after start");
    r.assert_nothing_left();
}
