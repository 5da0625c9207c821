//! Text to token ids: a Hugging Face `tokenizer.json` run by the `tokenizers` crate (the same
//! code the Python library wraps), or plain UTF-8 bytes for models without a tokenizer.

use std::path::{Path, PathBuf};

use miette::Diagnostic;
use thiserror::Error;
use tokenizers::Tokenizer;

use crate::indexed::Dtype;
use crate::memo::WordMemo;
use crate::options::TokenizerSource;
use crate::untrusted::{excerpt, read_bounded, resolve_inside};

/// End-of-document id of the byte-level tokenizer.
pub const BYTE_LEVEL_EOD: u32 = 256;
/// tokenizer.json files larger than this are refused before being read.
const MAX_TOKENIZER_BYTES: u64 = 1 << 30;
const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// Special tokens taken as end of document, in order, when tokenizer_config.json names none.
const EOD_CANDIDATES: [&str; 5] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>"];

#[derive(Debug, Error, Diagnostic)]
pub enum TokenizerError {
    #[error("cannot load tokenizer {}: {}", .path.display(), excerpt(.message))]
    #[diagnostic(code(mflow::data::tokenizer::load), help("pass a valid Hugging Face tokenizer.json (as saved by `tokenizers` or `transformers`)"))]
    Load { path: PathBuf, message: String },

    #[error("tokenizer {path} is {size} bytes, more than the {limit} accepted")]
    #[diagnostic(code(mflow::data::tokenizer::too_large), help("check that the path names a tokenizer.json and not a model file"))]
    TooLarge { path: PathBuf, size: u64, limit: u64 },

    #[error("tokenizer {} has no end-of-document token (no eos_token in tokenizer_config.json and none of {candidates})", .path.display())]
    #[diagnostic(
        code(mflow::data::tokenizer::no_eod),
        help("name the token that ends each document with --eod, e.g. --eod '</s>'; special tokens of this tokenizer: {}", excerpt(specials))
    )]
    NoEod { path: PathBuf, candidates: String, specials: String },

    #[error("--eod {token:?} is not a token of {path}")]
    #[diagnostic(code(mflow::data::tokenizer::unknown_eod), help("give a token string from the vocabulary (or its id); special tokens of this tokenizer: {}", excerpt(specials)))]
    UnknownEod { token: String, path: PathBuf, specials: String },

    #[error("tokenizer {} failed to encode a document: {}", .path.display(), excerpt(.message))]
    #[diagnostic(code(mflow::data::tokenizer::encode), help("the tokenizer.json may be incomplete; check it loads with `tokenizers.Tokenizer.from_file`"))]
    Encode { path: PathBuf, message: String },
}

// One per tokenizer, so the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
enum Kind {
    Hf { tokenizer: Box<Tokenizer>, path: PathBuf, memo: Option<WordMemo> },
    ByteLevel,
}

/// Encodes documents and appends the end-of-document id.
pub struct Encoder {
    kind: Kind,
    eod: u32,
    eod_token: String,
    vocab_size: u64,
    add_special_tokens: bool,
    dtype: Dtype,
}

impl Encoder {
    pub fn load(source: &TokenizerSource, eod: Option<&str>, add_special_tokens: bool) -> Result<Encoder, TokenizerError> {
        match source {
            TokenizerSource::ByteLevel => Ok(Encoder {
                kind: Kind::ByteLevel,
                eod: BYTE_LEVEL_EOD,
                eod_token: "<eod>".into(),
                vocab_size: BYTE_LEVEL_EOD as u64 + 1,
                add_special_tokens,
                dtype: Dtype::Uint16,
            }),
            TokenizerSource::HfFile(path) => load_hf(path, eod, add_special_tokens),
        }
    }

    pub fn with_dtype(mut self, dtype: Dtype) -> Encoder {
        self.dtype = dtype;
        self
    }

    /// Encodes through a per-worker word memo of at most `cap_bytes` in all (see [`crate::memo`]),
    /// when the tokenizer allows it; the ids stay those of `Tokenizer::encode`. `workers` is the
    /// size of the rayon pool that will call [`Encoder::encode_into`]. A cap of 0 turns it off.
    pub fn with_word_memo(mut self, workers: usize, cap_bytes: usize) -> Encoder {
        if let Kind::Hf { tokenizer, memo, .. } = &mut self.kind {
            *memo = WordMemo::for_tokenizer(tokenizer, self.add_special_tokens, workers, cap_bytes);
        }
        self
    }

    /// Whether [`Encoder::encode_into`] goes through the word memo rather than `encode_fast`.
    pub fn uses_word_memo(&self) -> bool {
        matches!(&self.kind, Kind::Hf { memo: Some(_), .. })
    }

    /// Whether the word memo cuts words with mflow's own pre-tokenizer (see [`crate::pretokenize`])
    /// rather than the crate's.
    pub fn uses_lean_splitter(&self) -> bool {
        matches!(&self.kind, Kind::Hf { memo: Some(memo), .. } if memo.lean().is_some())
    }

    /// Which encode path runs, in a few words for the output: mflow's scanner or the
    /// pattern's regex under the word memo, the crate's pre-tokenizer under it, the crate's
    /// `encode`, or bytes.
    pub fn path(&self) -> String {
        match &self.kind {
            Kind::ByteLevel => "bytes".into(),
            Kind::Hf { memo: None, .. } => "tokenizers encode".into(),
            Kind::Hf { memo: Some(memo), .. } => match memo.lean() {
                Some(lean) => format!("{} + word memo", lean.path()),
                None => "tokenizers pre-tokenizer + word memo".into(),
            },
        }
    }

    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// One more than the largest id the tokenizer can produce.
    pub fn vocab_size(&self) -> u64 {
        self.vocab_size
    }

    pub fn eod(&self) -> u32 {
        self.eod
    }

    pub fn eod_token(&self) -> &str {
        &self.eod_token
    }

    /// The tokenizer.json in use, if any.
    pub fn tokenizer_file(&self) -> Option<&Path> {
        match &self.kind {
            Kind::Hf { path, .. } => Some(path),
            Kind::ByteLevel => None,
        }
    }

    pub fn add_special_tokens(&self) -> bool {
        self.add_special_tokens
    }

    /// Appends the ids of `text`, cut to `max_tokens`, then the end-of-document id. Returns
    /// whether the document was truncated.
    pub fn encode_into(&self, text: &str, max_tokens: Option<u64>, out: &mut Vec<u32>) -> Result<bool, TokenizerError> {
        let start = out.len();
        match &self.kind {
            Kind::ByteLevel => out.extend(text.bytes().map(u32::from)),
            Kind::Hf { tokenizer, path, memo } => {
                let encode_err = |e: tokenizers::Error| TokenizerError::Encode { path: path.clone(), message: e.to_string() };
                match memo {
                    Some(memo) => memo.encode_into(tokenizer, text, out).map_err(encode_err)?,
                    None => out.extend_from_slice(tokenizer.encode_fast(text, self.add_special_tokens).map_err(encode_err)?.get_ids()),
                }
            }
        }
        let truncated = match max_tokens {
            Some(max) if (out.len() - start) as u64 > max => {
                out.truncate(start + max as usize);
                true
            }
            _ => false,
        };
        out.push(self.eod);
        Ok(truncated)
    }
}

fn load_hf(path: &Path, eod: Option<&str>, add_special_tokens: bool) -> Result<Encoder, TokenizerError> {
    let load_err = |message: String| TokenizerError::Load { path: path.to_path_buf(), message };
    let size = std::fs::metadata(path).map_err(|e| load_err(e.to_string()))?.len();
    if size > MAX_TOKENIZER_BYTES {
        return Err(TokenizerError::TooLarge { path: path.to_path_buf(), size, limit: MAX_TOKENIZER_BYTES });
    }
    // Read through a checked descriptor: a FIFO in the file's place must not block the load.
    let bytes = read_bounded(path, MAX_TOKENIZER_BYTES).map_err(|e| load_err(e.to_string()))?;
    let mut tokenizer = Tokenizer::from_bytes(&bytes).map_err(|e| load_err(e.to_string()))?;
    drop(bytes);
    // transformers ignores truncation/padding stored in tokenizer.json unless asked; so do we
    tokenizer.with_truncation(None).map_err(|e| load_err(e.to_string()))?;
    tokenizer.with_padding(None);

    let vocab = tokenizer.get_vocab(true);
    let vocab_size = vocab.values().copied().max().map_or(0, |m| m as u64 + 1);
    let mut specials: Vec<(u32, String)> = tokenizer
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| t.special)
        .map(|(id, t)| (id, t.content))
        .collect();
    specials.sort();
    let special_list = || {
        let names: Vec<&str> = specials.iter().take(20).map(|(_, s)| s.as_str()).collect();
        if names.is_empty() { "(none)".to_string() } else { names.join(" ") }
    };

    let (eod_id, eod_token) = match eod {
        Some(token) => match tokenizer.token_to_id(token) {
            Some(id) => (id, token.to_string()),
            None => match token.parse::<u64>() {
                Ok(id) if id < vocab_size => {
                    let id = id as u32;
                    (id, tokenizer.id_to_token(id).unwrap_or_default())
                }
                _ => {
                    return Err(TokenizerError::UnknownEod {
                        token: token.to_string(),
                        path: path.to_path_buf(),
                        specials: special_list(),
                    })
                }
            },
        },
        None => {
            let configured = config_eos_token(path).and_then(|t| tokenizer.token_to_id(&t).map(|id| (id, t)));
            let fallback = || {
                EOD_CANDIDATES.iter().find_map(|c| specials.iter().find(|(_, s)| s == c).map(|(id, s)| (*id, s.clone())))
            };
            configured.or_else(fallback).ok_or_else(|| TokenizerError::NoEod {
                path: path.to_path_buf(),
                candidates: EOD_CANDIDATES.join(" "),
                specials: special_list(),
            })?
        }
    };
    Ok(Encoder {
        kind: Kind::Hf { tokenizer: Box::new(tokenizer), path: path.to_path_buf(), memo: None },
        eod: eod_id,
        eod_token,
        vocab_size,
        add_special_tokens,
        dtype: Dtype::optimal(vocab_size),
    })
}

/// `eos_token` of the tokenizer_config.json beside `tokenizer_json`, as transformers reads it.
/// A config that is missing, not a regular file, too large, or linked out of the tokenizer's
/// directory is ignored (the end-of-document token then comes from the fallbacks or --eod).
fn config_eos_token(tokenizer_json: &Path) -> Option<String> {
    let dir = match tokenizer_json.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let cfg = resolve_inside(dir, "tokenizer_config.json").ok()??;
    eos_token_of_config(&read_bounded(&cfg, MAX_CONFIG_BYTES).ok()?)
}

/// `eos_token` of a tokenizer_config.json document, as transformers reads it; `None` if the
/// document is not JSON or names none. Never panics (fuzzed).
pub fn eos_token_of_config(bytes: &[u8]) -> Option<String> {
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return None;
    }
    let value: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    match value.get("eos_token")? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}
