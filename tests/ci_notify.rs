//! `[notify] webhook`: a JSON summary POSTed after the run, retried with backoff; a failed
//! notification never fails the run and never prints the URL's secrets.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::mpsc;

use common::{code, stderr, Project};

/// A webhook on 127.0.0.1 that answers the first `failures` requests with 503, then 200.
/// Sends each request's body to the channel.
fn webhook(failures: usize) -> (u16, mpsc::Receiver<serde_json::Value>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for (n, stream) in listener.incoming().enumerate() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut len = 0usize;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap();
                }
            }
            let mut body = vec![0; len];
            reader.read_exact(&mut body).unwrap();
            let status = if n < failures { "503 Service Unavailable" } else { "200 OK" };
            let _ = stream
                .write_all(format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").as_bytes());
            let _ = tx.send(serde_json::from_slice(&body).unwrap());
        }
    });
    (port, rx)
}

fn spec(url: &str, fail: bool) -> String {
    format!(
        "[pipeline]\nname = \"notified\"\n\n[notify]\nwebhook = \"{url}\"\ntimeout = \"2s\"\nretries = 2\n\n[stages.a]\nkind = \"command\"\nrun = [\"sh\", \"-c\", \"{}\"]\n",
        if fail { "exit 1" } else { "echo ok" }
    )
}

#[test]
fn retries_until_accepted_and_posts_the_summary() {
    let (port, rx) = webhook(1);
    let p = Project::new(&spec(&format!("http://bot:s3cret@127.0.0.1:{port}/hooks/T0/s3cret?token=s3cret"), false));
    let o = p.run(&[]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(!stderr(&o).contains("s3cret"));
    let first = rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap();
    let second = rx.recv_timeout(std::time::Duration::from_secs(5)).expect("a retry after the 503");
    assert_eq!(first, second);
    assert_eq!(second["status"], "succeeded");
    assert_eq!(second["pipeline"], "notified");
    assert_eq!(second["exit_code"], 0);
    assert_eq!(second["stages"][0]["name"], "a");
    assert!(second["text"].as_str().unwrap().contains("notified succeeded"));
    assert!(rx.try_recv().is_err(), "no request after the accepted one");
}

#[test]
fn failures_are_notified_too() {
    let (port, rx) = webhook(0);
    let p = Project::new(&spec(&format!("http://127.0.0.1:{port}/hook"), true));
    assert_eq!(code(&p.run(&[])), 1);
    let body = rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap();
    assert_eq!(body["status"], "failed");
    assert_eq!(body["exit_code"], 1);
    assert!(body["text"].as_str().unwrap().contains("failed: a"));
}

#[test]
fn an_unreachable_webhook_only_warns_and_hides_secrets() {
    // A port nobody listens on.
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let p = Project::new(&spec(&format!("http://u:pw-s3cret@127.0.0.1:{port}/hooks/T0/s3cret?token=s3cret"), false));
    let o = p.run(&[]);
    assert_eq!(code(&o), 0, "a failed notification must not fail the run");
    let err = stderr(&o);
    assert!(err.contains(&format!("warning: notification to http://127.0.0.1:{port}/hooks/… failed")), "{err}");
    assert!(err.contains("3 attempt(s)"), "{err}");
    assert!(!err.contains("s3cret"), "{err}");
}

/// `webhook = "env:NAME"` keeps the URL out of the spec and its copies: it is read from mflow's
/// environment when the run ends.
#[test]
fn a_webhook_read_from_the_environment_is_sent_and_never_recorded() {
    let (port, rx) = webhook(0);
    let url = format!("http://127.0.0.1:{port}/hooks/T0/s3cret");
    let p = Project::new(&spec("env:MFLOW_TEST_WEBHOOK", false));
    let o = p.cmd(&["run", "spec.toml"]).env("MFLOW_TEST_WEBHOOK", &url).output().unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let body = rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap();
    assert_eq!(body["status"], "succeeded");
    let record = p.latest_record().to_string();
    assert!(!record.contains("s3cret"), "{record}");
    // Unset: the run still ends as it did, with a warning.
    let o = p.cmd(&["run", "spec.toml"]).env_remove("MFLOW_TEST_WEBHOOK").output().unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stderr(&o).contains("MFLOW_TEST_WEBHOOK"), "{}", stderr(&o));
    // A name that cannot be an environment variable is refused where it is written.
    p.write_spec(&spec("env:NOT A NAME", false));
    let o = p.mflow(&["validate", "spec.toml"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
}
