//! Hostile tokenizers and inputs: a FIFO in place of a file must not block the build, a huge
//! string in a tokenizer must not become a huge message, and a model directory's tokenizer
//! files must resolve inside it.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

const TOK: &str = "tests/fixtures/tokenizer";

fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs)).expect("did not return in time (blocked?)")
}

fn fails(argv: Vec<String>) -> String {
    let err = within(30, move || {
        let refs: Vec<&str> = argv.iter().map(String::as_str).collect();
        run(&refs).expect_err("the build must fail")
    });
    render(&err)
}

fn mkfifo(p: &Path) {
    assert!(Command::new("mkfifo").arg(p).status().unwrap().success());
}

fn corpus(tmp: &Path) -> String {
    let p = tmp.join("c.txt");
    std::fs::write(&p, "hello world\n").unwrap();
    p.display().to_string()
}

#[test]
fn fifo_tokenizer_and_fifo_input_are_refused_without_blocking() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ds").display().to_string();
    let fifo_tok = tmp.path().join("tokenizer.json");
    mkfifo(&fifo_tok);
    let text = fails(vec![corpus(tmp.path()), "--tokenizer".into(), fifo_tok.display().to_string(), "--out".into(), out.clone()]);
    assert!(text.contains("tokenizer.json") && text.contains("FIFO"), "{text}");

    let fifo_in = tmp.path().join("in.txt");
    mkfifo(&fifo_in);
    let text = fails(vec![fifo_in.display().to_string(), "--tokenizer".into(), TOK.into(), "--out".into(), out]);
    assert!(text.contains("in.txt") && text.contains("FIFO"), "{text}");
}

#[test]
fn a_huge_string_in_a_tokenizer_gives_a_short_message() {
    let tmp = tempfile::tempdir().unwrap();
    let tok: serde_json::Value = serde_json::from_slice(&std::fs::read(format!("{TOK}/tokenizer.json")).unwrap()).unwrap();
    let mut tok = tok.as_object().unwrap().clone();
    tok.insert("version".into(), "9".repeat(100 << 20).into());
    let path = tmp.path().join("tokenizer.json");
    std::fs::write(&path, serde_json::to_vec(&tok).unwrap()).unwrap();
    drop(tok);
    let out = tmp.path().join("ds").display().to_string();
    let text = fails(vec![corpus(tmp.path()), "--tokenizer".into(), path.display().to_string(), "--out".into(), out]);
    assert!(text.len() < 1500, "{} byte message", text.len());
    assert!(text.contains("cannot load tokenizer"), "{}", &text[..text.len().min(500)]);
}

#[test]
fn tokenizer_files_linked_out_of_their_directory_are_not_used() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    std::fs::create_dir(&model).unwrap();
    let elsewhere = tmp.path().join("elsewhere.json");
    std::fs::copy(format!("{TOK}/tokenizer.json"), &elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, model.join("tokenizer.json")).unwrap();
    let out = tmp.path().join("ds").display().to_string();
    let text = fails(vec![corpus(tmp.path()), "--tokenizer".into(), model.display().to_string(), "--out".into(), out.clone()]);
    assert!(text.contains("resolves to") && text.contains("outside"), "{text}");

    // tokenizer_config.json linked elsewhere is ignored: its eos_token is not taken.
    std::fs::remove_file(model.join("tokenizer.json")).unwrap();
    std::fs::copy(format!("{TOK}/tokenizer.json"), model.join("tokenizer.json")).unwrap();
    let tok: serde_json::Value = serde_json::from_slice(&std::fs::read(model.join("tokenizer.json")).unwrap()).unwrap();
    let ordinary = tok["model"]["vocab"].as_object().unwrap().keys().find(|k| k.len() > 1 && k.chars().all(|c| c.is_ascii_alphabetic())).unwrap().clone();
    let cfg = tmp.path().join("cfg.json");
    std::fs::write(&cfg, serde_json::json!({"eos_token": ordinary}).to_string()).unwrap();
    std::os::unix::fs::symlink(&cfg, model.join("tokenizer_config.json")).unwrap();
    run(&[&corpus(tmp.path()), "--tokenizer", model.to_str().unwrap(), "--out", &out]).unwrap();
    let meta: serde_json::Value = serde_json::from_slice(&std::fs::read(Path::new(&out).join("dataset.json")).unwrap()).unwrap();
    assert_ne!(meta["eod_token"], serde_json::Value::from(ordinary.clone()));
    // The same config as a regular file inside the directory is taken.
    std::fs::remove_file(model.join("tokenizer_config.json")).unwrap();
    std::fs::copy(&cfg, model.join("tokenizer_config.json")).unwrap();
    let out2 = tmp.path().join("ds2").display().to_string();
    run(&[&corpus(tmp.path()), "--tokenizer", model.to_str().unwrap(), "--out", &out2]).unwrap();
    let meta: serde_json::Value = serde_json::from_slice(&std::fs::read(Path::new(&out2).join("dataset.json")).unwrap()).unwrap();
    assert_eq!(meta["eod_token"], serde_json::Value::from(ordinary));
}

#[test]
fn eos_lookup_never_panics_on_odd_configs() {
    for doc in [&b""[..], b"[]", b"{\"eos_token\": 5}", b"{\"eos_token\": {\"content\": []}}", b"\xff\xfe", b"{\"eos_token\": \"</s>\"}"] {
        let _ = mflow_data::tokenize::eos_token_of_config(doc);
    }
    assert_eq!(mflow_data::tokenize::eos_token_of_config(br#"{"eos_token": {"content": "</s>"}}"#).as_deref(), Some("</s>"));
}
