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
    let text = fails(vec![
        corpus(tmp.path()),
        "--tokenizer".into(),
        fifo_tok.display().to_string(),
        "--out".into(),
        out.clone(),
    ]);
    assert!(text.contains("tokenizer.json") && text.contains("FIFO"), "{text}");

    let fifo_in = tmp.path().join("in.txt");
    mkfifo(&fifo_in);
    let text = fails(vec![fifo_in.display().to_string(), "--tokenizer".into(), TOK.into(), "--out".into(), out]);
    assert!(text.contains("in.txt") && text.contains("FIFO"), "{text}");
}

#[test]
fn a_huge_string_in_a_tokenizer_gives_a_short_message() {
    let tmp = tempfile::tempdir().unwrap();
    let tok: serde_json::Value =
        serde_json::from_slice(&std::fs::read(format!("{TOK}/tokenizer.json")).unwrap()).unwrap();
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
    let text =
        fails(vec![corpus(tmp.path()), "--tokenizer".into(), model.display().to_string(), "--out".into(), out.clone()]);
    assert!(text.contains("resolves to") && text.contains("outside"), "{text}");

    // tokenizer_config.json linked elsewhere is refused, naming it: its eos_token is not taken,
    // and not silently replaced by another either.
    std::fs::remove_file(model.join("tokenizer.json")).unwrap();
    std::fs::copy(format!("{TOK}/tokenizer.json"), model.join("tokenizer.json")).unwrap();
    let tok: serde_json::Value = serde_json::from_slice(&std::fs::read(model.join("tokenizer.json")).unwrap()).unwrap();
    let ordinary = tok["model"]["vocab"]
        .as_object()
        .unwrap()
        .keys()
        .find(|k| k.len() > 1 && k.chars().all(|c| c.is_ascii_alphabetic()))
        .unwrap()
        .clone();
    let cfg = tmp.path().join("cfg.json");
    std::fs::write(&cfg, serde_json::json!({"eos_token": ordinary}).to_string()).unwrap();
    std::os::unix::fs::symlink(&cfg, model.join("tokenizer_config.json")).unwrap();
    let args =
        || vec![corpus(tmp.path()), "--tokenizer".into(), model.display().to_string(), "--out".into(), out.clone()];
    let text = fails(args());
    assert!(text.contains("tokenizer_config.json") && text.contains("outside"), "{text}");
    assert!(!Path::new(&out).exists());
    // So is one that is not JSON, or names a token the tokenizer does not have.
    std::fs::remove_file(model.join("tokenizer_config.json")).unwrap();
    for (doc, says) in [
        ("{\"eos_token\": ", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ("{\"eos_token\": 7}", "neither a string"),
        ("{\"eos_token\": \"<no such token>\"}", "is not a token of"),
    ] {
        std::fs::write(model.join("tokenizer_config.json"), doc).unwrap();
        let text = fails(args());
        assert!(
            text.contains("tokenizer_config.json") && text.contains(says) && text.contains("--eod"),
            "{doc}: {text}"
        );
        // --eod decides without the config.
        let out3 = tmp.path().join("ds3");
        let eod = ["--eod".to_string(), "<|endoftext|>".into()];
        let mut with_eod = args();
        with_eod[4] = out3.display().to_string();
        with_eod.extend(eod);
        run(&with_eod.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        std::fs::remove_dir_all(&out3).unwrap();
    }
    // The same config as a regular file inside the directory is taken.
    std::fs::remove_file(model.join("tokenizer_config.json")).unwrap();
    std::fs::copy(&cfg, model.join("tokenizer_config.json")).unwrap();
    let out2 = tmp.path().join("ds2").display().to_string();
    run(&[&corpus(tmp.path()), "--tokenizer", model.to_str().unwrap(), "--out", &out2]).unwrap();
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(Path::new(&out2).join("dataset.json")).unwrap()).unwrap();
    assert_eq!(meta["eod_token"], serde_json::Value::from(ordinary));
}

/// `--eod` of digits is an id: a byte-level vocabulary has the tokens "0" to "9" too.
#[test]
fn an_eod_of_digits_is_an_id_not_the_digit_token() {
    let tmp = tempfile::tempdir().unwrap();
    let tok: serde_json::Value =
        serde_json::from_slice(&std::fs::read(format!("{TOK}/tokenizer.json")).unwrap()).unwrap();
    let vocab = tok["model"]["vocab"].as_object().unwrap();
    let digit = vocab["0"].as_u64().unwrap();
    assert_ne!(digit, 0, "the fixture's digit token is not id 0");
    let token_of = |id: u64| vocab.iter().find(|(_, v)| v.as_u64() == Some(id)).map(|(k, _)| k.clone()).unwrap();
    for (n, (eod, id)) in
        [("0", 0), ("2", 2), ("<|endoftext|>", tok["added_tokens"][0]["id"].as_u64().unwrap())].into_iter().enumerate()
    {
        let out = tmp.path().join(format!("ds-{n}"));
        run(&[&corpus(tmp.path()), "--tokenizer", TOK, "--out", out.to_str().unwrap(), "--eod", eod]).unwrap();
        let meta: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("dataset.json")).unwrap()).unwrap();
        assert_eq!(meta["eod_id"], id, "--eod {eod}");
        if eod.starts_with('<') {
            continue;
        }
        assert_eq!(meta["eod_token"], serde_json::Value::from(token_of(id)), "--eod {eod}");
    }
    let out = tmp.path().join("ds-big").display().to_string();
    let text = fails(vec![
        corpus(tmp.path()),
        "--tokenizer".into(),
        TOK.into(),
        "--out".into(),
        out,
        "--eod".into(),
        "99999999".into(),
    ]);
    assert!(text.contains("not a token or an id"), "{text}");
}

#[test]
fn eos_lookup_never_panics_on_odd_configs() {
    for doc in [
        &b""[..],
        b"[]",
        b"{\"eos_token\": 5}",
        b"{\"eos_token\": {\"content\": []}}",
        b"\xff\xfe",
        b"{\"eos_token\": \"</s>\"}",
    ] {
        let _ = mflow_data::tokenize::eos_token_of_config(doc);
    }
    let eos = |doc: &[u8]| mflow_data::tokenize::eos_token_of_config(doc);
    assert_eq!(eos(br#"{"eos_token": {"content": "</s>"}}"#), Ok(Some("</s>".into())));
    assert_eq!(eos(br#"{"eos_token": null, "x": 1}"#), Ok(None));
    assert_eq!(eos(br#"{}"#), Ok(None));
    assert!(eos(b"\xff\xfe").is_err() && eos(b"[]").is_err() && eos(br#"{"eos_token": 5}"#).is_err());
}

/// Re-runs this test binary on test `name` with its address space limited to `mib` and
/// MFLOW_MEMORY_BUDGET set to `budget`; true in the child, which does the work.
fn in_child(name: &str, mib: u64, budget: &str) -> bool {
    if std::env::var_os("MFLOW_TEST_CHILD").is_some() {
        return true;
    }
    let exe = std::env::current_exe().unwrap();
    let script = format!("ulimit -v {} && exec \"$0\" --exact {name} --nocapture --test-threads 1", mib * 1024);
    let out = Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg(&exe)
        .env("MFLOW_TEST_CHILD", "1")
        .env("MFLOW_MEMORY_BUDGET", budget)
        .output()
        .unwrap();
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && log.contains("1 passed"), "child under a {mib} MiB limit failed:\n{log}");
    eprintln!("{log}");
    false
}

fn status_mib(key: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with(key)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() / 1024
}

/// What `f` returns, and how far the resident set rose while it ran, in MiB (the peak is
/// reset first, so that building the input does not count).
fn rss_rise<T>(f: impl FnOnce() -> T) -> (T, u64) {
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let before = status_mib("VmRSS:");
    let value = f();
    let rise = status_mib("VmHWM:").saturating_sub(before);
    eprintln!("resident set: {before} MiB before, {rise} MiB more at the most");
    (value, rise)
}

fn word(state: &mut u64, len: usize) -> String {
    (0..len)
        .map(|_| {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            (b'a' + (*state % 26) as u8) as char
        })
        .collect()
}

/// Tokenizers whose loading would hold 300 MB to 1.3 GB (a Unigram of pieces that share no
/// prefix, a model with nested arrays, a vocabulary of a million words, long added tokens):
/// each refused from its shape before the `tokenizers` crate reads it, with the figure, while
/// the resident set rises by little more than the file.
#[test]
fn tokenizers_past_the_memory_budget_are_refused_before_they_are_loaded() {
    if !in_child("tokenizers_past_the_memory_budget_are_refused_before_they_are_loaded", 1024, "256MiB") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let base: serde_json::Value =
        serde_json::from_slice(&std::fs::read(format!("{TOK}/tokenizer.json")).unwrap()).unwrap();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut unigram = base.clone();
    let mut pieces = vec![serde_json::json!(["<unk>", 0.0])];
    pieces.extend((0..100_000).map(|_| serde_json::json!([word(&mut state, 32), -1.0])));
    unigram["model"] = serde_json::json!({"type": "Unigram", "unk_id": 0, "vocab": pieces, "byte_fallback": false});
    let mut words = base.clone();
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..1_000_000).map(|i| (format!("{}{i}", word(&mut state, 4)), i.into())).collect();
    words["model"] = serde_json::json!({"type": "WordLevel", "unk_token": "<|endoftext|>", "vocab": vocab});
    let mut added = base.clone();
    let tokens: Vec<serde_json::Value> = (0..10_000)
        .map(|i| {
            serde_json::json!({"id": 1000 + i, "content": word(&mut state, 500), "single_word": false,
                                    "lstrip": false, "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    added["added_tokens"] = tokens.into();
    let nested = {
        let text = serde_json::to_string(&base).unwrap();
        let at = text.find("\"model\":{").unwrap() + "\"model\":{".len();
        let deep = format!("[{}[]]", "[[[[[[[[[[]]]]]]]]]],".repeat(250_000));
        format!("{}\"junk\":{deep},{}", &text[..at], &text[at..])
    };
    let cases = [
        ("unigram", serde_json::to_string(&unigram).unwrap(), "the trie of its 100001 pieces"),
        ("words", serde_json::to_string(&words).unwrap(), "1000000 vocabulary entries"),
        ("added", serde_json::to_string(&added).unwrap(), "10000 added tokens (5000000 bytes)"),
        ("nested", nested, "2502042 values in all"),
    ];
    drop((unigram, words, added));
    for (name, text, part) in cases {
        let path = tmp.path().join(format!("{name}.json"));
        std::fs::write(&path, &text).unwrap();
        let size_mib = text.len() >> 20;
        drop(text);
        let out = tmp.path().join("ds").display().to_string();
        let argv = [corpus(tmp.path()), "--tokenizer".into(), path.display().to_string(), "--out".into(), out.clone()];
        let (err, rise) = rss_rise(|| fails(argv.to_vec()));
        eprintln!("{name} ({size_mib} MiB): {err}");
        assert!(
            err.starts_with(&format!(
                "[mflow::data::tokenizer::memory] tokenizer {}: loading it would need about ",
                path.display()
            )) && err.contains(part)
                && err.contains("more than the memory budget of 256.0 MiB (MFLOW_MEMORY_BUDGET)")
                && err.contains("help: a model or tokenizer of this size is far beyond any real one"),
            "{err}"
        );
        // Its text, read to be measured.
        assert!(rise < size_mib as u64 + 16, "{name}: {rise} MiB");
        assert_no_output(Path::new(&out));
    }
}

/// A real tokenizer loads and encodes under a budget of 16 MiB; a budget that is not an amount
/// of memory is an error naming it.
#[test]
fn the_budget_leaves_real_tokenizers_alone() {
    if !in_child("the_budget_leaves_real_tokenizers_alone", 2048, "16MiB") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ds").display().to_string();
    run(&[&corpus(tmp.path()), "--tokenizer", TOK, "--out", &out]).unwrap();
    std::env::set_var("MFLOW_MEMORY_BUDGET", "lots");
    let text = fails(vec![corpus(tmp.path()), "--tokenizer".into(), TOK.into(), "--out".into(), format!("{out}-2")]);
    assert!(
        text.starts_with("[mflow::data::memory_budget] MFLOW_MEMORY_BUDGET = \"lots\" is not an amount of memory"),
        "{text}"
    );
}
