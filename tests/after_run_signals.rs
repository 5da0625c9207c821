//! Signals after every stage has ended: a webhook that does not answer keeps mflow neither from
//! hearing SIGINT or SIGTERM nor from ending at once, 130 or 143, with its record written.

mod common;

use std::net::TcpListener;
use std::process::Stdio;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::Project;

/// A webhook on 127.0.0.1 that accepts and never answers; each connection is said on the channel.
fn silent_webhook() -> (u16, mpsc::Receiver<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut held = vec![];
        for stream in listener.incoming().flatten() {
            held.push(stream);
            let _ = tx.send(());
        }
    });
    (port, rx)
}

/// Runs a one-stage spec whose webhook never answers, sends `signal` once mflow waits for it,
/// and returns the exit code and how long mflow took to end after the signal.
fn signalled_while_notifying(signal: libc::c_int) -> (Project, Option<i32>, Duration) {
    let (port, accepted) = silent_webhook();
    let p = Project::new(&format!(
        "[pipeline]\nname = \"n\"\n\n[notify]\nwebhook = \"http://127.0.0.1:{port}/hook\"\ntimeout = \"30s\"\nretries = 3\n\n\
         [stages.a]\nkind = \"command\"\nrun = [\"sh\", \"-c\", \"echo ok\"]\n"
    ));
    let mut child = p.cmd(&["run", "spec.toml"]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    accepted.recv_timeout(Duration::from_secs(30)).expect("the webhook is called");
    std::thread::sleep(Duration::from_millis(200));
    let (code, took) = signal_and_wait(&mut child, signal);
    (p, code, took)
}

/// Sends `signal` to `child` and waits for it to end (killed after 20 s): its exit code and
/// how long it took.
fn signal_and_wait(child: &mut std::process::Child, signal: libc::c_int) -> (Option<i32>, Duration) {
    let t0 = Instant::now();
    // SAFETY: a signal to the mflow process this test started.
    unsafe { libc::kill(child.id() as i32, signal) };
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return (s.code(), t0.elapsed());
        }
        if t0.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("mflow did not end within 20 s of the signal");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn sigint_while_the_webhook_is_waited_for_ends_mflow_with_130() {
    let (p, code, took) = signalled_while_notifying(libc::SIGINT);
    assert_eq!(code, Some(130));
    assert!(took < Duration::from_secs(2), "mflow took {took:?} to end after SIGINT");
    assert_eq!(p.latest_record()["status"], "succeeded", "the run's record stands");
}

#[test]
fn sigterm_while_the_webhook_is_waited_for_ends_mflow_with_143() {
    let (p, code, took) = signalled_while_notifying(libc::SIGTERM);
    assert_eq!(code, Some(143));
    assert!(took < Duration::from_secs(2), "mflow took {took:?} to end after SIGTERM");
    assert_eq!(p.latest_record()["status"], "succeeded", "the run's record stands");
}

#[test]
fn a_second_signal_after_a_cancelled_run_ends_mflow_at_once() {
    let (port, accepted) = silent_webhook();
    let p = Project::new("");
    let started = p.file("started");
    p.write_spec(&format!(
        "[pipeline]\nname = \"n\"\n\n[notify]\nwebhook = \"http://127.0.0.1:{port}/hook\"\ntimeout = \"30s\"\nretries = 3\n\n\
         [stages.a]\nkind = \"command\"\nrun = [\"sh\", \"-c\", \"touch {}; sleep 60\"]\n",
        started.display()
    ));
    let mut child = p.cmd(&["run", "spec.toml"]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let t = Instant::now();
    while !started.exists() {
        assert!(t.elapsed() < Duration::from_secs(20), "the stage never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: signals to the mflow process this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    accepted.recv_timeout(Duration::from_secs(30)).expect("the cancelled run is notified");
    std::thread::sleep(Duration::from_millis(200));
    let (code, took) = signal_and_wait(&mut child, libc::SIGINT);
    assert_eq!(code, Some(130));
    assert!(took < Duration::from_secs(1), "mflow took {took:?} after the second SIGINT");
    assert_eq!(p.latest_record()["status"], "cancelled");
}
