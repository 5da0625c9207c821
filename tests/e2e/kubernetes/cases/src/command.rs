//! The `mflow` binary as a user runs it: a process of its own, with an exit code and the words
//! it prints.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::case::Outside;
use crate::Suite;

/// One `mflow` command of a case: `c.mflow(["run", spec]).code(3).run().contains("forbidden")`.
#[must_use = "a command does nothing until it is run"]
pub struct Mflow {
    suite: Suite,
    /// The program: the suite's mflow, or another one that runs it (see [`Mflow::program`]).
    program: PathBuf,
    args: Vec<OsString>,
    env: Vec<(OsString, Option<OsString>)>,
    dir: Option<PathBuf>,
    code: i32,
    timeout: Option<Duration>,
    outside: bool,
}

impl Mflow {
    /// `mflow ARGS` with the suite's environment: no colours, an mflow home of the suite's, and
    /// the admin's kubeconfig.
    pub fn new<I, S>(suite: &Suite, args: I) -> Mflow
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        let env = vec![
            ("NO_COLOR".into(), Some("1".into())),
            ("MFLOW_HOME".into(), Some(suite.state.join("mflow-home").into())),
            ("KUBECONFIG".into(), Some(suite.kubeconfig("admin").into())),
        ];
        Mflow {
            suite: suite.clone(),
            program: suite.bin.clone(),
            args: args.into_iter().map(Into::into).collect(),
            env,
            dir: None,
            code: 0,
            timeout: None,
            outside: false,
        }
    }

    /// Runs `program` in place of the suite's mflow, with the same environment: a tool that
    /// drives mflow (Papermill running the notebook).
    pub fn program(mut self, program: impl Into<PathBuf>) -> Self {
        self.program = program.into();
        self
    }

    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.args.push(arg.into());
        self
    }

    pub fn args<I: IntoIterator<Item = S>, S: Into<OsString>>(mut self, args: I) -> Self {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    pub fn env(mut self, name: &str, value: impl Into<OsString>) -> Self {
        self.env.push((name.into(), Some(value.into())));
        self
    }

    pub fn env_remove(mut self, name: &str) -> Self {
        self.env.push((name.into(), None));
        self
    }

    /// Runs as the identity of this kubeconfig.
    pub fn kubeconfig(self, path: impl Into<OsString>) -> Self {
        self.env("KUBECONFIG", path)
    }

    pub fn dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dir = Some(dir.into());
        self
    }

    /// The exit code `run` expects (default 0).
    pub fn code(mut self, code: i32) -> Self {
        self.code = code;
        self
    }

    /// Kills mflow after this long, which then counts as exit code 124 (as `timeout` says).
    pub fn timeout(mut self, limit: Duration) -> Self {
        self.timeout = Some(limit);
        self
    }

    /// Runs with the volume absent, as on a laptop (see [`Outside`]).
    pub fn outside(mut self) -> Self {
        self.outside = true;
        self
    }

    fn describe(&self) -> String {
        let args: Vec<String> = self.args.iter().map(|a| a.to_string_lossy().into_owned()).collect();
        let name = self.program.file_name().unwrap_or_default().to_string_lossy();
        format!("{name} {}", args.join(" "))
    }

    /// Starts mflow and returns at once; `Running::wait` ends it.
    pub fn spawn(self) -> Running {
        assert!(!self.outside, "spawn: hold `Case::outside()` for the time the volume is away");
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        for (name, value) in &self.env {
            match value {
                Some(v) => cmd.env(name, v),
                None => cmd.env_remove(name),
            };
        }
        if let Some(dir) = &self.dir {
            cmd.current_dir(dir);
        }
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("starting {}: {e}", self.program.display()));
        let text = Arc::new(Mutex::new(String::new()));
        let stdout = Arc::new(Mutex::new(String::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let readers = vec![
            read_into(child.stdout.take().expect("piped stdout"), text.clone(), stdout.clone()),
            read_into(child.stderr.take().expect("piped stderr"), text.clone(), stderr.clone()),
        ];
        Running { what: self.describe(), child: Some(child), text, stdout, stderr, readers, started: Instant::now() }
    }

    /// Runs mflow to its end, prints what it printed, and checks its exit code.
    pub fn run(self) -> Out {
        let _away = self.outside.then(|| Outside::new(&self.suite));
        let (code, timeout) = (self.code, self.timeout);
        let running = Mflow { outside: false, ..self }.spawn();
        let out = match timeout {
            Some(limit) => running.wait_at_most(limit),
            None => running.wait(),
        };
        assert_eq!(out.code, code, "exit code of `{}` (expected {code}, got {})", out.what, out.code);
        out
    }
}

/// Copies a pipe into `text` (both streams, a line at a time) and into `own` (this stream).
fn read_into(pipe: impl Read + Send + 'static, text: Arc<Mutex<String>>, own: Arc<Mutex<String>>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(pipe);
        let mut line = Vec::new();
        while reader.read_until(b'\n', &mut line).is_ok_and(|n| n > 0) {
            let s = String::from_utf8_lossy(&line);
            text.lock().expect("output").push_str(&s);
            own.lock().expect("output").push_str(&s);
            line.clear();
        }
    })
}

/// An mflow that runs in the background (to be signalled, or watched while it runs).
pub struct Running {
    what: String,
    child: Option<Child>,
    text: Arc<Mutex<String>>,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
    readers: Vec<JoinHandle<()>>,
    started: Instant,
}

impl Running {
    /// What it printed so far, both streams.
    pub fn text(&self) -> String {
        self.text.lock().expect("output").clone()
    }

    /// Whether it printed a line containing `needle` so far.
    pub fn printed(&self, needle: &str) -> bool {
        self.text().lines().any(|l| l.contains(needle))
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// Sends `signal` (`libc::SIGINT`, ...), as a terminal or `kill` does.
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) with the pid of our own child, which we have not reaped yet.
        let rc = unsafe { libc::kill(self.pid(), signal) };
        assert_eq!(rc, 0, "kill -{signal} {}", self.pid());
    }

    /// Waits for the end; the exit code is 128 + N for a process that signal N ended.
    pub fn wait(mut self) -> Out {
        let status = self.child.take().expect("a child").wait().expect("waiting for mflow");
        self.finish(status)
    }

    /// Waits at most `limit`, then kills it (exit code 124, as `timeout` reports).
    pub fn wait_at_most(mut self, limit: Duration) -> Out {
        let mut child = self.child.take().expect("a child");
        loop {
            if let Some(status) = child.try_wait().expect("waiting for mflow") {
                return self.finish(status);
            }
            if self.started.elapsed() >= limit {
                let _ = child.kill();
                let _ = child.wait();
                let mut out = self.finish(Default::default());
                println!("(killed after {}s)", limit.as_secs());
                out.code = 124;
                return out;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn finish(&mut self, status: std::process::ExitStatus) -> Out {
        use std::os::unix::process::ExitStatusExt;
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        let code = status.code().or(status.signal().map(|s| 128 + s)).unwrap_or(-1);
        let out = Out {
            what: self.what.clone(),
            code,
            text: self.text(),
            stdout: self.stdout.lock().expect("output").clone(),
            stderr: self.stderr.lock().expect("output").clone(),
        };
        println!("$ {} (exit {code}, {:.1}s)\n{}", out.what, self.started.elapsed().as_secs_f64(), out.text);
        out
    }
}

impl Drop for Running {
    /// A case that fails while mflow runs does not leave it behind.
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
            println!("$ {} (killed: the case ended first)\n{}", self.what, self.text());
        }
    }
}

/// What an mflow command printed, and its exit code.
#[derive(Debug, Clone)]
pub struct Out {
    pub what: String,
    pub code: i32,
    /// Both streams, a line at a time in the order they came.
    pub text: String,
    /// Standard output alone.
    pub stdout: String,
    /// Standard error alone.
    pub stderr: String,
}

impl Out {
    pub fn contains(&self, needle: &str) -> &Self {
        assert!(self.text.contains(needle), "expected `{}` to print: {needle}", self.what);
        self
    }

    pub fn not_contains(&self, needle: &str) -> &Self {
        assert!(!self.text.contains(needle), "did not expect `{}` to print: {needle}", self.what);
        self
    }

    /// The same output as one line (see [`crate::flat`]), for sentences a report wraps.
    pub fn flat(&self) -> Out {
        Out { text: crate::flat(&self.text), ..self.clone() }
    }

    /// The number of lines containing `needle`.
    pub fn count_lines(&self, needle: &str) -> usize {
        self.text.lines().filter(|l| l.contains(needle)).count()
    }

    /// The last line printed.
    pub fn last_line(&self) -> &str {
        self.text.lines().last().unwrap_or("")
    }
}
