//! The word memo and the lean byte-level splitter give exactly the ids of the tokenizer's own
//! `encode`: compared with the Python `tokenizers` library (through Megatron's reader) and with
//! mflow's own build without the memo, on a corpus of repeated, unusual and special-token-laden
//! words, for several tokenizer shapes.

mod common;

use std::path::Path;

use common::*;
use mflow_data::options::TokenizerSource;
use mflow_data::tokenize::Encoder;
use serde_json::json;

const CORPUS: &str = "tests/fixtures/memo/tricky.jsonl";

fn build_with(tok: &str, out: &Path, memo_mib: &str, threads: &str, extra: &[&str]) -> Vec<u8> {
    let mut argv = vec![CORPUS, "--tokenizer", tok, "--out", out.to_str().unwrap(), "--splits", "100,0,0"];
    argv.extend(["--word-memo-mib", memo_mib, "--threads", threads]);
    argv.extend(extra);
    run(&argv).unwrap();
    [std::fs::read(out.join("train.bin")).unwrap(), std::fs::read(out.join("train.idx")).unwrap()].concat()
}

/// Builds `tok` with the memo (large, and small enough to be emptied many times) and without
/// it, checks that all agree byte for byte and that the memo build matches Python tokenizers.
fn check_tokenizer(tok: &str, add_special_tokens: bool) {
    let tmp = tempfile::tempdir().unwrap();
    let extra: &[&str] = if add_special_tokens { &[] } else { &["--no-special-tokens"] };
    let with_memo = build_with(tok, &tmp.path().join("memo"), "64", "2", extra);
    let evicting = build_with(tok, &tmp.path().join("small"), "1", "1", extra);
    let without = build_with(tok, &tmp.path().join("plain"), "0", "2", extra);
    assert!(with_memo == without, "{tok}: memo and plain encode differ");
    assert!(evicting == without, "{tok}: a memo emptied when full differs from plain encode");
    let report = check_dataset(&tmp.path().join("memo"), json!({
        "tokenizer": tok, "add_special_tokens": add_special_tokens, "dtype": "uint16",
        "sources": [{"path": CORPUS, "format": "jsonl", "text_key": "text"}],
    }));
    assert!(report["documents"].as_u64().unwrap() > 500, "{report}");
}

fn encoder(tok: &str) -> Encoder {
    Encoder::load(&TokenizerSource::HfFile(tok.into()), None, true).unwrap().with_word_memo(2, 64 << 20)
}

/// A copy of the fixture tokenizer with its normalizer / pre-tokenizer replaced.
fn variant(dir: &Path, name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let mut tok: serde_json::Value =
        serde_json::from_slice(&std::fs::read("tests/fixtures/tokenizer/tokenizer.json").unwrap()).unwrap();
    edit(&mut tok);
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_vec(&tok).unwrap()).unwrap();
    path.to_str().unwrap().to_string()
}

#[test]
fn gpt2_style_tokenizers_match_with_and_without_special_tokens() {
    for tok in ["tests/fixtures/tokenizer/tokenizer.json", "tests/fixtures/tokenizer-bos/tokenizer.json"] {
        assert!(encoder(tok).uses_lean_splitter(), "{tok} should take the lean byte-level path");
        check_tokenizer(tok, true);
        check_tokenizer(tok, false);
    }
}

#[test]
fn other_tokenizer_shapes_match() {
    let tmp = tempfile::tempdir().unwrap();
    // Llama-3 style: a Split regex, then ByteLevel without its own regex (lean path)
    let llama3 = variant(tmp.path(), "llama3", |t| {
        t["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
             "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]});
    });
    // Qwen2 style NFC normalizer, and a prefix space: the memo over the crate's own pre-tokenizer
    let nfc = variant(tmp.path(), "nfc", |t| t["normalizer"] = json!({"type": "NFC"}));
    let prefix = variant(tmp.path(), "prefix", |t| t["pre_tokenizer"]["add_prefix_space"] = json!(true));
    for (tok, lean) in [(&llama3, true), (&nfc, false), (&prefix, false)] {
        let enc = encoder(tok);
        assert!(enc.uses_word_memo(), "{tok}");
        assert_eq!(enc.uses_lean_splitter(), lean, "{tok}");
        check_tokenizer(tok, true);
    }
}

#[test]
fn bpe_dropout_turns_the_memo_off() {
    let tmp = tempfile::tempdir().unwrap();
    let dropout = variant(tmp.path(), "dropout", |t| t["model"]["dropout"] = json!(0.5));
    assert!(!encoder(&dropout).uses_word_memo());
    assert!(encoder("tests/fixtures/tokenizer/tokenizer.json").uses_word_memo());
    let off = Encoder::load(&TokenizerSource::HfFile("tests/fixtures/tokenizer/tokenizer.json".into()), None, true)
        .unwrap()
        .with_word_memo(2, 0);
    assert!(!off.uses_word_memo(), "a cap of 0 turns the memo off");
}
