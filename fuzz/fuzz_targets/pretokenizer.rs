//! Compares mflow's own pre-tokenizer (the GPT-2 and Llama-3 scanners, and the regex path of
//! another pattern) with the `tokenizers` crate's pre-tokenizer on arbitrary text: the words
//! must be the same, in the same order, in the byte-level alphabet.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use mflow_data::pretokenize::{crate_words, ByteLevelSplitter};
use tokenizers::Tokenizer;

const GPT2: &str = include_str!("../../crates/mflow-data/tests/fixtures/tokenizer/tokenizer.json");
const SPLITS: [&str; 2] = [
    // Llama-3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    // Qwen2 (the regex path)
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

static SPLITTERS: LazyLock<Vec<(Tokenizer, ByteLevelSplitter)>> = LazyLock::new(|| {
    let mut tokenizers = vec![Tokenizer::from_bytes(GPT2).unwrap()];
    for pattern in SPLITS {
        let mut tok: serde_json::Value = serde_json::from_str(GPT2).unwrap();
        tok["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]});
        tokenizers.push(Tokenizer::from_bytes(serde_json::to_vec(&tok).unwrap()).unwrap());
    }
    tokenizers
        .into_iter()
        .map(|tok| {
            let splitter = ByteLevelSplitter::for_tokenizer(&tok).expect("a byte-level tokenizer");
            (tok, splitter)
        })
        .collect()
});

fuzz_target!(|data: &[u8]| {
    // documents reach the tokenizer as valid UTF-8 (others are skipped or refused before)
    let text = String::from_utf8_lossy(data);
    for (tok, splitter) in SPLITTERS.iter() {
        let expected = crate_words(tok.get_pre_tokenizer().unwrap(), &text).unwrap();
        assert_eq!(splitter.words(&text), expected, "{} on {text:?}", splitter.path());
    }
});
