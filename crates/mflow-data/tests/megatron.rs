//! Datasets read back with Megatron-Core's own IndexedDataset and GPTDataset (through
//! `$MFLOW_PYTHON`), compared token by token with the Python `tokenizers` library.

mod common;

use common::*;
use serde_json::json;

const TOK: &str = "tests/fixtures/tokenizer/tokenizer.json";

fn sources(entries: &[(&str, &str)]) -> serde_json::Value {
    entries.iter().map(|(p, f)| json!({"path": p, "format": f, "text_key": "text"})).collect()
}

#[test]
fn mixed_jsonl_and_text_match_python_tokenizers() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ds");
    let summary = run(&[
        "tests/fixtures/corpus/*.txt",
        "tests/fixtures/corpus/docs.jsonl",
        "--tokenizer",
        "tests/fixtures/tokenizer",
        "--out",
        out.to_str().unwrap(),
        "--split-by",
        "blank-line",
        "--splits",
        "1,1,1",
        "--seed",
        "7",
    ])
    .unwrap();
    // sorted paths: apache-2.0.txt, crlf.txt, docs.jsonl, notes.txt
    let report = check_dataset(
        &out,
        json!({
            "tokenizer": TOK, "add_special_tokens": true, "dtype": "uint16",
            "sources": sources(&[
                (&fixture("corpus/apache-2.0.txt"), "blank-line"), (&fixture("corpus/crlf.txt"), "blank-line"),
                (&fixture("corpus/docs.jsonl"), "jsonl"), (&fixture("corpus/notes.txt"), "blank-line"),
            ]),
        }),
    );
    assert_eq!(report["documents"], summary.stats.documents);
    for split in ["train", "valid", "test"] {
        assert!(summary.stats.splits[split].documents > 0, "{split} is empty");
    }
    assert_eq!(summary.stats.skipped.empty, 1, "the empty JSONL text is skipped");
    let meta: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("dataset.json")).unwrap()).unwrap();
    assert_eq!(meta["eod_id"], 0);
    assert_eq!(meta["vocab_size"], 700);
    assert_eq!(meta["tokenizer"], "tokenizer.json");
}

#[test]
fn every_text_split_mode_matches() {
    for mode in ["file", "line", "blank-line"] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("ds");
        run(&["tests/fixtures/corpus/*.txt", "--tokenizer", TOK, "--out", out.to_str().unwrap(), "--split-by", mode])
            .unwrap();
        check_dataset(
            &out,
            json!({
                "tokenizer": TOK, "add_special_tokens": true, "dtype": "uint16",
                "sources": sources(&[
                    (&fixture("corpus/apache-2.0.txt"), mode), (&fixture("corpus/crlf.txt"), mode),
                    (&fixture("corpus/notes.txt"), mode),
                ]),
            }),
        );
    }
}

#[test]
fn bos_tokenizer_special_tokens_on_and_off() {
    let tok = "tests/fixtures/tokenizer-bos/tokenizer.json";
    for (flag, add) in [(None, true), (Some("--no-special-tokens"), false)] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("ds");
        let mut argv = vec!["tests/fixtures/corpus/docs.jsonl", "--tokenizer", tok, "--out", out.to_str().unwrap()];
        argv.extend(flag);
        run(&argv).unwrap();
        let report = check_dataset(
            &out,
            json!({
                "tokenizer": tok, "add_special_tokens": add, "dtype": "uint16",
                "sources": sources(&[(&fixture("corpus/docs.jsonl"), "jsonl")]),
            }),
        );
        // no tokenizer_config.json: <|endoftext|> is found among the special tokens
        assert_eq!(report["eod"], 0);
        let train = std::fs::read(out.join("train.bin")).unwrap();
        assert_eq!(u16::from_le_bytes([train[0], train[1]]) == 1, add, "BOS <s> (id 1) leads only with special tokens");
    }
}

#[test]
fn byte_level_and_truncation() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ds");
    let summary = run(&[
        "tests/fixtures/corpus/notes.txt",
        "--tokenizer",
        "byte-level",
        "--out",
        out.to_str().unwrap(),
        "--split-by",
        "line",
        "--max-doc-tokens",
        "20",
        "--splits",
        "2,1,1",
    ])
    .unwrap();
    check_dataset(
        &out,
        json!({
            "tokenizer": "byte-level", "add_special_tokens": true, "dtype": "uint16", "max_doc_tokens": 20,
            "sources": sources(&[(&fixture("corpus/notes.txt"), "line")]),
        }),
    );
    assert!(summary.stats.truncated_documents > 0);
    assert!(!out.join("tokenizer.json").exists());
}

#[test]
fn large_vocabulary_is_written_as_int32() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tmp.path().join("tokenizer.json");
    word_level_tokenizer(&tok, 70_000, &["<|endoftext|>"]);
    let corpus = tmp.path().join("c.txt");
    std::fs::write(&corpus, "w1 w69999 w65536\nw2 w3 unknown\n").unwrap();
    let out = tmp.path().join("ds");
    run(&[
        corpus.to_str().unwrap(),
        "--tokenizer",
        tok.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--split-by",
        "line",
        "--splits",
        "1,0,0",
    ])
    .unwrap();
    check_dataset(
        &out,
        json!({
            "tokenizer": tok, "add_special_tokens": true, "dtype": "int32",
            "sources": sources(&[(corpus.to_str().unwrap(), "line")]),
        }),
    );
}

#[test]
fn gptdataset_builds_training_samples() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ds");
    run(&[
        "tests/fixtures/corpus/*.txt",
        "tests/fixtures/corpus/docs.jsonl",
        "--tokenizer",
        "tests/fixtures/tokenizer",
        "--out",
        out.to_str().unwrap(),
        "--split-by",
        "blank-line",
        "--splits",
        "1,0,0",
    ])
    .unwrap();
    let cache = tmp.path().join("cache");
    let report = run_python("check_gptdataset.py", &[&out, std::path::Path::new("tests/fixtures/tokenizer"), &cache]);
    let report: serde_json::Value = serde_json::from_str(report.lines().last().unwrap()).unwrap();
    assert!(report["samples"].as_u64().unwrap() >= 40, "{report}");
}
