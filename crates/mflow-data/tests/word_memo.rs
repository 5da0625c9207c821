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
    let report = check_dataset(
        &tmp.path().join("memo"),
        json!({
            "tokenizer": tok, "add_special_tokens": add_special_tokens, "dtype": "uint16",
            "sources": [{"path": CORPUS, "format": "jsonl", "text_key": "text"}],
        }),
    );
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
    for (tok, path) in [
        (&llama3, "scanner (llama3) + word memo + byte-level merges"),
        (&nfc, "tokenizers pre-tokenizer + word memo"),
        (&prefix, "tokenizers pre-tokenizer + word memo"),
    ] {
        let enc = encoder(tok);
        assert!(enc.uses_word_memo(), "{tok}");
        assert_eq!(enc.path(), path, "{tok}");
        assert_eq!(enc.uses_lean_splitter(), path.starts_with("scanner"), "{tok}");
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
    assert_eq!(off.path(), "tokenizers encode");
    assert_eq!(Encoder::load(&TokenizerSource::ByteLevel, None, true).unwrap().path(), "bytes");
}

/// Tokenizers the scanner does not cover keep the crate's own pre-tokenizer under the memo:
/// SentencePiece-style (Metaspace, Unigram, NFKC) and BERT-style (WordPiece, lower-casing
/// normalizer, a [CLS] ... [SEP] frame).
#[test]
fn sentencepiece_and_wordpiece_shapes_match() {
    let tmp = tempfile::tempdir().unwrap();
    let letters: Vec<String> = ('a'..='z').chain('A'..='Z').chain('0'..='9').map(String::from).collect();
    let special = |id: usize, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
               "normalized": false, "special": true})
    };
    let mut pieces = vec![json!(["<unk>", 0.0]), json!(["</s>", 0.0]), json!(["▁", -2.0])];
    for (n, w) in ["▁the", "▁of", "▁and", "▁license", "the", "ing", "▁a", "▁fn", "▁self"].iter().enumerate()
    {
        pieces.push(json!([w, -3.0 - n as f64 / 10.0]));
    }
    pieces.extend(letters.iter().map(|l| json!([l, -8.0])));
    let unigram = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [special(1, "</s>")],
        "normalizer": {"type": "NFKC"},
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true},
        "post_processor": null, "decoder": null,
        "model": {"type": "Unigram", "unk_id": 0, "vocab": pieces, "byte_fallback": false}
    });
    let mut vocab = serde_json::Map::new();
    for w in ["[UNK]", "[CLS]", "[SEP]", "</s>", "the", "of", "and", "license", "##s", "##ing", "fn", "self"]
        .into_iter()
        .map(String::from)
        .chain(letters.iter().flat_map(|l| [l.clone(), format!("##{l}")]))
    {
        let id = vocab.len();
        vocab.entry(w).or_insert(id.into());
    }
    let (cls, sep) = (vocab["[CLS]"].clone(), vocab["[SEP]"].clone());
    let wordpiece = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "[UNK]"), special(1, "[CLS]"), special(2, "[SEP]"), special(3, "</s>")],
        "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true, "strip_accents": null, "lowercase": true},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [cls], "tokens": ["[CLS]"]}, "[SEP]": {"id": "[SEP]", "ids": [sep], "tokens": ["[SEP]"]}}},
        "decoder": null,
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##", "max_input_chars_per_word": 100, "vocab": vocab}
    });
    for (name, tok) in [("unigram", unigram), ("wordpiece", wordpiece)] {
        let path = tmp.path().join(format!("{name}.json"));
        std::fs::write(&path, serde_json::to_vec(&tok).unwrap()).unwrap();
        let path = path.to_str().unwrap();
        assert_eq!(encoder(path).path(), "tokenizers pre-tokenizer + word memo", "{name}");
        check_tokenizer(path, true);
    }
}
