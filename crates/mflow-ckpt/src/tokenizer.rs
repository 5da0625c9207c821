//! The tokenizer of the init presets: a byte-level BPE trained, deterministically, on a small
//! built-in text so that presets work without any download.

use std::collections::HashSet;
use std::path::Path;

use serde_json::json;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper, TokenizerBuilder,
};

use crate::error::{io, CkptError};

/// Vocabulary size of the trained tokenizer (bytes, merges and the special token).
pub const VOCAB_SIZE: u64 = 1024;
pub const END_OF_TEXT: &str = "<|endoftext|>";
/// The special token is added first, so it takes id 0.
pub const END_OF_TEXT_ID: u64 = 0;

const SAMPLE: &str = include_str!("tokenizer_sample.txt");

/// The training text: the sample plus sentences built from its vocabulary by a fixed recipe,
/// which gives the trainer enough repeated pairs to reach [`VOCAB_SIZE`].
fn corpus() -> Vec<String> {
    let mut lines: Vec<String> = SAMPLE.lines().filter(|l| !l.is_empty()).map(str::to_string).collect();
    let words: Vec<&str> = SAMPLE.split_whitespace().collect();
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..400 {
        let mut sentence = Vec::new();
        for _ in 0..12 {
            // xorshift: a fixed, portable sequence.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            sentence.push(words[(state % words.len() as u64) as usize]);
        }
        lines.push(sentence.join(" "));
    }
    lines
}

/// Trains the tokenizer and writes tokenizer.json, tokenizer_config.json and
/// special_tokens_map.json into `dir`.
pub fn write(dir: &Path, max_length: u64) -> Result<(), CkptError> {
    let err = |e: tokenizers::Error| CkptError::Tokenizer { reason: e.to_string() };
    let alphabet: HashSet<char> = ByteLevel::alphabet().into_iter().collect();
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(VOCAB_SIZE as usize)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(alphabet)
        .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
        .build();
    let mut tok =
        TokenizerBuilder::<BPE, NormalizerWrapper, PreTokenizerWrapper, PostProcessorWrapper, DecoderWrapper>::new()
            .with_model(BPE::default())
            .with_normalizer(None)
            .with_pre_tokenizer(Some(ByteLevel::new(false, true, true).into()))
            .with_post_processor(Some(ByteLevel::new(false, true, true).into()))
            .with_decoder(Some(ByteLevel::new(false, true, true).into()))
            .build()
            .map_err(err)?;
    tok.train(&mut trainer, corpus().into_iter()).map_err(err)?;
    let size = tok.get_vocab_size(true) as u64;
    if size != VOCAB_SIZE {
        return Err(CkptError::Tokenizer { reason: format!("trained {size} tokens instead of {VOCAB_SIZE}") });
    }
    if tok.token_to_id(END_OF_TEXT) != Some(END_OF_TEXT_ID as u32) {
        return Err(CkptError::Tokenizer { reason: format!("{END_OF_TEXT} did not get id {END_OF_TEXT_ID}") });
    }
    let path = dir.join("tokenizer.json");
    tok.save(&path, true).map_err(err)?;
    let config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": END_OF_TEXT,
        "eos_token": END_OF_TEXT,
        "unk_token": END_OF_TEXT,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": false,
    });
    let special = json!({"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT, "unk_token": END_OF_TEXT});
    for (name, v) in [("tokenizer_config.json", config), ("special_tokens_map.json", special)] {
        let p = dir.join(name);
        std::fs::write(&p, serde_json::to_string_pretty(&v).expect("json")).map_err(io(&p))?;
    }
    Ok(())
}
