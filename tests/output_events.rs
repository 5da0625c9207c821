//! A stage's output lines as run events: each one said before the end of its attempt (in the
//! JSON lines and on the console), held in a bounded buffer on the way, and a line split only
//! where it is longer than the limit.

mod common;

use std::io::Read;
use std::process::Stdio;
use std::time::Duration;

use common::{code, stderr, stdout, Project};

/// A spec of command stages `(name, needs, script)`.
fn spec(stages: &[(&str, &str, &str)]) -> String {
    let mut s = String::from("[pipeline]\nname = \"out\"\n");
    for (name, needs, script) in stages {
        let needs = if needs.is_empty() { String::new() } else { format!("needs = [\"{needs}\"]\n") };
        s += &format!("[stages.{name}]\nkind = \"command\"\n{needs}run = [\"sh\", \"-c\", '''{script}''']\n");
    }
    s
}

/// The JSON events of a run, in order.
fn events(o: &std::process::Output) -> Vec<serde_json::Value> {
    stdout(o).lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// Where the first event of `kind` for `stage` is.
fn position(evs: &[serde_json::Value], kind: &str, stage: &str) -> usize {
    evs.iter().position(|e| e["event"] == kind && e["stage"] == stage).unwrap_or_else(|| panic!("no {kind} of {stage}"))
}

fn outputs<'a>(evs: &'a [serde_json::Value], stage: &'a str) -> impl Iterator<Item = (usize, &'a str)> + 'a {
    evs.iter()
        .enumerate()
        .filter(move |(_, e)| e["event"] == "output" && e["stage"] == stage)
        .map(|(i, e)| (i, e["line"].as_str().unwrap()))
}

#[test]
fn every_output_line_comes_before_its_attempt_ends_and_the_next_stage_starts() {
    let p = Project::new(&spec(&[("a", "", "seq 1 20000"), ("b", "a", "echo B")]));
    let o = p.run(&["--log-format", "json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let evs = events(&o);
    let lines: Vec<(usize, &str)> = outputs(&evs, "a").collect();
    let expected: Vec<String> = (1..=20000).map(|n| n.to_string()).collect();
    assert_eq!(lines.iter().map(|(_, l)| l.to_string()).collect::<Vec<_>>(), expected);
    let last = lines.last().unwrap().0;
    let ended = position(&evs, "attempt_ended", "a");
    assert!(last < ended, "a's line at {last} after its attempt_ended at {ended}");
    assert!(ended < position(&evs, "stage_succeeded", "a"));
    assert!(ended < position(&evs, "stage_started", "b"));
    let (b_line, _) = outputs(&evs, "b").next().expect("b's line");
    assert!(b_line < position(&evs, "attempt_ended", "b"));
}

#[test]
fn on_the_console_too_every_line_comes_before_the_stage_ends() {
    let p = Project::new(&spec(&[("a", "", "seq 1 20000"), ("b", "a", "echo B")]));
    let o = p.run(&[]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let err = stderr(&o);
    let at = |needle: &str| err.find(needle).unwrap_or_else(|| panic!("no {needle:?} in\n{err}"));
    assert!(at("a | 20000\n") < at("✓ a succeeded"), "{err}");
    assert!(at("✓ a succeeded") < at("▶ b started"));
    assert!(at("b | B\n") < at("✓ b succeeded"));
}

#[test]
fn a_short_line_comes_before_its_attempt_ends_every_time() {
    let p = Project::new(&spec(&[("a", "", "echo hello")]));
    for n in 0..20 {
        let o = p.run(&["--log-format", "json", "--force", "a"]);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        let evs = events(&o);
        let (line, text) = outputs(&evs, "a").next().unwrap_or_else(|| panic!("run {n}: no output"));
        assert_eq!(text, "hello");
        assert!(line < position(&evs, "attempt_ended", "a"), "run {n}: output after attempt_ended");
    }
}

/// The peak resident memory of process `pid` so far, in kB.
fn peak_kb(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

#[test]
fn a_stage_printing_faster_than_stdout_is_read_does_not_grow_mflow() {
    // 64 MB in lines of 1,000 bytes, printed at once; mflow's standard output is read slowly.
    let script = "yes $(printf '%0999d' 0) | head -n 64000";
    let p = Project::new(&spec(&[("a", "", script)]));
    let mut child = p.cmd(&["run", "spec.toml", "--log-format", "json"]).stdout(Stdio::piped()).spawn().unwrap();
    let pid = child.id();
    let mut out = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let (mut buf, mut lines) = (vec![0u8; 16 << 10], 0usize);
        loop {
            match out.read(&mut buf) {
                Ok(0) | Err(_) => return lines,
                Ok(n) => lines += buf[..n].iter().filter(|&&b| b == b'\n').count(),
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    });
    let mut peak = 0;
    while child.try_wait().unwrap().is_none() {
        peak = peak.max(peak_kb(pid).unwrap_or(0));
        std::thread::sleep(Duration::from_millis(20));
    }
    let events = reader.join().unwrap();
    assert!(child.wait().unwrap().success());
    assert!(events > 64000, "{events} events");
    assert!(peak < 48 << 10, "mflow grew to {} MB while its output was read slowly", peak >> 10);
}

/// The lengths of a's output events.
fn line_lengths(p: &Project) -> Vec<usize> {
    let o = p.run(&["--log-format", "json", "--force", "a"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    outputs(&events(&o), "a").map(|(_, l)| l.len()).collect()
}

#[test]
fn a_line_of_exactly_the_limit_is_one_event_and_a_longer_one_is_split() {
    const MIB: usize = 1 << 20;
    let line = |n: usize| format!("head -c {n} /dev/zero | tr '\\0' x; echo");
    for (n, expected) in
        [(MIB, vec![MIB]), (MIB - 1, vec![MIB - 1]), (MIB + 1, vec![MIB, 1]), (2 * MIB, vec![MIB, MIB])]
    {
        let p = Project::new(&spec(&[("a", "", &format!("{}; echo after", line(n)))]));
        let mut expected = expected;
        expected.push(5);
        assert_eq!(line_lengths(&p), expected, "a line of {n} bytes");
    }
}

/// Runs `yes` as a stage (with `extra` in its table) while mflow's output is read slowly, so
/// that the stage blocks on its full pipe; `signal` after a second if given. The exit code and
/// how long mflow ran.
fn blocked_stage(extra: &str, signal: Option<libc::c_int>) -> (Option<i32>, Duration) {
    let p = Project::new(
        &spec(&[("a", "", "yes")]).replace("kind = \"command\"\n", &format!("kind = \"command\"\n{extra}\n")),
    );
    let t0 = std::time::Instant::now();
    let mut child = p.cmd(&["run", "spec.toml", "--log-format", "json"]).stdout(Stdio::piped()).spawn().unwrap();
    let mut out = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 16 << 10];
        while out.read(&mut buf).is_ok_and(|n| n > 0) {
            std::thread::sleep(Duration::from_millis(2));
        }
    });
    if let Some(signal) = signal {
        std::thread::sleep(Duration::from_secs(1));
        // SAFETY: a signal to the mflow process this test started.
        unsafe { libc::kill(child.id() as i32, signal) };
    }
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("a stage blocked on its output was never stopped");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    reader.join().unwrap();
    (child.wait().unwrap().code(), t0.elapsed())
}

#[test]
fn a_stage_blocked_on_its_full_pipe_still_times_out() {
    let (code, took) = blocked_stage("timeout = \"2s\"", None);
    assert_eq!(code, Some(3));
    assert!(took < Duration::from_secs(30), "{took:?}");
}

#[test]
fn a_stage_blocked_on_its_full_pipe_is_still_stopped_by_sigint_and_sigterm() {
    for (signal, expected) in [(libc::SIGINT, 130), (libc::SIGTERM, 143)] {
        let (code, took) = blocked_stage("", Some(signal));
        assert_eq!(code, Some(expected));
        assert!(took < Duration::from_secs(30), "{took:?}");
    }
}
