//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Parser;
use mflow_data::{build, BuildError, DatasetArgs, Options, Summary};
use miette::Diagnostic;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: DatasetArgs,
}

/// Parses a command line as `mflow dataset` would.
pub fn args(argv: &[&str]) -> DatasetArgs {
    let mut full = vec!["mflow-dataset"];
    full.extend_from_slice(argv);
    Cli::try_parse_from(full).expect("arguments parse").args
}

pub fn run(argv: &[&str]) -> Result<Summary, BuildError> {
    let opts = Options::from_args(&args(argv))?;
    build(&opts)
}

pub fn fixture(rel: &str) -> String {
    format!("tests/fixtures/{rel}")
}

/// `[code] message / help: ...` of an error, followed by its causes.
pub fn render(e: &dyn Diagnostic) -> String {
    let mut s = String::new();
    if let Some(code) = e.code() {
        s.push_str(&format!("[{code}] "));
    }
    s.push_str(&e.to_string());
    let mut src = std::error::Error::source(e);
    while let Some(cause) = src {
        s.push_str(&format!("\ncaused by: {cause}"));
        src = cause.source();
    }
    if let Some(help) = e.help() {
        s.push_str(&format!("\nhelp: {help}"));
    }
    s
}

/// The Python with megatron-core, tokenizers and numpy, from `MFLOW_PYTHON`.
pub fn python() -> String {
    std::env::var("MFLOW_PYTHON").unwrap_or_else(|_| {
        panic!("set MFLOW_PYTHON to a Python interpreter with megatron-core, torch, tokenizers and numpy installed")
    })
}

/// Runs a checker script under tests/py and returns its stdout; panics with its stderr on failure.
pub fn run_python(script: &str, args: &[&Path]) -> String {
    let out = Command::new(python())
        .arg(format!("tests/py/{script}"))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot start MFLOW_PYTHON: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{script} failed ({}):\n{}\n{}",
        out.status,
        stdout,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Checks a dataset against Megatron's reader and the Python tokenizers library.
pub fn check_dataset(dir: &Path, config: serde_json::Value) -> serde_json::Value {
    let mut config = config;
    config["dataset"] = serde_json::json!(dir);
    let cfg_path = dir.with_extension("check.json");
    std::fs::write(&cfg_path, serde_json::to_vec(&config).unwrap()).unwrap();
    let out = run_python("check_dataset.py", &[&cfg_path]);
    serde_json::from_str(out.lines().last().expect("a summary line")).expect("summary is JSON")
}

/// No output directory and no staging leftovers next to it.
pub fn assert_no_output(out: &Path) {
    assert!(!out.exists(), "{} was left behind", out.display());
    let parent = out.parent().unwrap();
    let leftovers: Vec<PathBuf> = std::fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().contains(".staging-"))
        .collect();
    assert!(leftovers.is_empty(), "staging directories left: {leftovers:?}");
}

/// A WordLevel tokenizer.json with `n` words `w0..w{n-1}` and optional special tokens.
pub fn word_level_tokenizer(path: &Path, n: usize, specials: &[&str]) {
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    for (i, s) in specials.iter().enumerate() {
        vocab.insert(s.to_string(), i.into());
        added.push(serde_json::json!({"id": i, "content": s, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}));
    }
    vocab.insert("[UNK]".into(), specials.len().into());
    for i in 0..n {
        vocab.insert(format!("w{i}"), (specials.len() + 1 + i).into());
    }
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    std::fs::write(path, serde_json::to_vec(&tok).unwrap()).unwrap();
}
