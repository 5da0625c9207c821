//! Text to token ids: a Hugging Face `tokenizer.json` run by the `tokenizers` crate (the same
//! code the Python library wraps), or plain UTF-8 bytes for models without a tokenizer.

use std::path::{Path, PathBuf};

use mflow_untrusted::budget::{Budget, Need, OverBudget};
use mflow_untrusted::json;
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
    #[diagnostic(
        code(mflow::data::tokenizer::load),
        help("pass a valid Hugging Face tokenizer.json (as saved by `tokenizers` or `transformers`)")
    )]
    Load { path: PathBuf, message: String },

    #[error("tokenizer {path} is {size} bytes, more than the {limit} accepted")]
    #[diagnostic(
        code(mflow::data::tokenizer::too_large),
        help("check that the path names a tokenizer.json and not a model file")
    )]
    TooLarge { path: PathBuf, size: u64, limit: u64 },

    #[error("tokenizer {}: {over}", .path.display())]
    #[diagnostic(
        code(mflow::data::tokenizer::memory),
        help(
            "a model or tokenizer of this size is far beyond any real one, so the file is likely corrupt or hostile; \
             if it is what you meant, set MFLOW_MEMORY_BUDGET to what this machine can hold (e.g. \
             MFLOW_MEMORY_BUDGET=64GiB; a stage's `env` table passes it to that stage)"
        )
    )]
    OverBudget { path: PathBuf, over: Box<OverBudget> },

    #[error("MFLOW_MEMORY_BUDGET = {} is not an amount of memory", excerpt(&format!("{value:?}")))]
    #[diagnostic(
        code(mflow::data::memory_budget),
        help("set it to a number of bytes, with a unit if you like (512MiB, 64GiB), or unset it for half of this machine's memory")
    )]
    BudgetSetting { value: String },

    #[error("tokenizer {} has no end-of-document token (no eos_token in tokenizer_config.json and none of {candidates})", .path.display())]
    #[diagnostic(
        code(mflow::data::tokenizer::no_eod),
        help("name the token that ends each document with --eod, e.g. --eod '</s>'; special tokens of this tokenizer: {}", excerpt(specials))
    )]
    NoEod { path: PathBuf, candidates: String, specials: String },

    #[error("{} cannot give the end-of-document token: {reason}", .path.display())]
    #[diagnostic(
        code(mflow::data::tokenizer::config),
        help(
            "fix or remove the file, or name the end-of-document token with --eod; special tokens of this tokenizer: {}",
            excerpt(specials)
        )
    )]
    Config { path: PathBuf, reason: String, specials: String },

    #[error("--eod {token:?} is not a token or an id of {path}")]
    #[diagnostic(
        code(mflow::data::tokenizer::unknown_eod),
        help(
            "give a token string from the vocabulary (or its id); special tokens of this tokenizer: {}",
            excerpt(specials)
        )
    )]
    UnknownEod { token: String, path: PathBuf, specials: String },

    #[error("tokenizer {} failed to encode a document: {}", .path.display(), excerpt(.message))]
    #[diagnostic(
        code(mflow::data::tokenizer::encode),
        help("the tokenizer.json may be incomplete; check it loads with `tokenizers.Tokenizer.from_file`")
    )]
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
    pub fn load(
        source: &TokenizerSource,
        eod: Option<&str>,
        add_special_tokens: bool,
    ) -> Result<Encoder, TokenizerError> {
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
                Some(lean) if memo.own_merges() => format!("{} + word memo + byte-level merges", lean.path()),
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
                let encode_err =
                    |e: tokenizers::Error| TokenizerError::Encode { path: path.clone(), message: e.to_string() };
                match memo {
                    Some(memo) => memo.encode_into(tokenizer, text, out).map_err(encode_err)?,
                    None => out.extend_from_slice(
                        tokenizer.encode_fast(text, self.add_special_tokens).map_err(encode_err)?.get_ids(),
                    ),
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

/// What loading a tokenizer.json holds at most, from the shape of its JSON, measured against
/// what the `tokenizers` crate and mflow's encoder hold while it loads (the example
/// `tokenizer-memory`; docs/validation.md has the figures): the text; the model twice over
/// (the crate reads it into a buffer of its own for an untagged enum, then into a JSON value,
/// then into its tables: a BPE of 128k tokens and pair merges held 18x its file), and the
/// tables of its vocabulary; the rest of the pipeline the same way; a Unigram model's trie (about 260 bytes per byte of its pieces when
/// they share no prefix: 207x its file); and the added tokens with the tries that find them
/// (about 60 bytes per byte of their contents). The word memo is bounded apart
/// (`--word-memo-mib`).
pub fn load_need(bytes: &[u8]) -> Result<Need, serde_json::Error> {
    const TWICE: u64 = 2;
    const TRIE_PER_BYTE: u64 = 320;
    const ADDED_TOKEN: u64 = 400;
    const ADDED_PER_BYTE: u64 = 72;
    const VOCAB_ENTRY: u64 = 96;
    // The encoder's own tables (the pre-tokenizer's classes, the word memo's front cache),
    // whatever the file.
    const ENCODER: u64 = 1 << 20;
    let paths: [&[&str]; 5] =
        [&["model"], &["model", "vocab"], &["model", "merges"], &["added_tokens"], &["added_tokens", "content"]];
    let (all, parts) = json::shape_at(bytes, &paths)?;
    let (model, vocab, merges, added, contents) = (parts[0], parts[1], parts[2], parts[3], parts[4]);
    // Entries of an object, or the arrays in an array of arrays (Unigram's [piece, score]).
    let entries = |p: &json::Shape| if p.objects > 0 { p.keys } else { p.arrays.saturating_sub(1).max(p.strings) };
    let rest = all.value_bytes().saturating_sub(model.value_bytes).saturating_sub(added.value_bytes);
    let mut need = Need::new();
    need.add("its text", bytes.len() as u64);
    need.add("the encoder's tables", ENCODER);
    need.add(
        format!(
            "its model ({} vocabulary entries, {} merges, {} values in all) held twice while it loads",
            entries(&vocab),
            entries(&merges),
            model.values()
        ),
        model.value_bytes.saturating_mul(TWICE),
    );
    need.add("the rest of its pipeline, held twice while it loads", rest.saturating_mul(TWICE));
    need.add(
        "its vocabulary's tables, and mflow's copy of it",
        entries(&vocab).saturating_mul(VOCAB_ENTRY).saturating_add(vocab.string_bytes.saturating_mul(2)),
    );
    if vocab.objects == 0 && vocab.arrays > 0 {
        need.add(
            format!("the trie of its {} pieces ({} bytes)", entries(&vocab), vocab.string_bytes),
            vocab.string_bytes.saturating_mul(TRIE_PER_BYTE),
        );
    }
    need.add(
        format!("{} added tokens ({} bytes) and the tries that find them", added.objects, contents.string_bytes),
        added.objects.saturating_mul(ADDED_TOKEN).saturating_add(contents.string_bytes.saturating_mul(ADDED_PER_BYTE)),
    );
    Ok(need)
}

fn load_hf(path: &Path, eod: Option<&str>, add_special_tokens: bool) -> Result<Encoder, TokenizerError> {
    let load_err = |message: String| TokenizerError::Load { path: path.to_path_buf(), message };
    let size = std::fs::metadata(path).map_err(|e| load_err(e.to_string()))?.len();
    if size > MAX_TOKENIZER_BYTES {
        return Err(TokenizerError::TooLarge { path: path.to_path_buf(), size, limit: MAX_TOKENIZER_BYTES });
    }
    // What loading it will hold, asked for before the crate allocates any of it: the text
    // first, then what its shape says.
    let budget = Budget::from_env().map_err(|e| TokenizerError::BudgetSetting { value: e.value })?;
    let over = |over| TokenizerError::OverBudget { path: path.to_path_buf(), over: Box::new(over) };
    budget.check("reading it", Need::new().add("its text", size).clone()).map_err(over)?;
    // Read through a checked descriptor: a FIFO in the file's place must not block the load.
    let bytes = read_bounded(path, MAX_TOKENIZER_BYTES).map_err(|e| load_err(e.to_string()))?;
    let need = load_need(&bytes).map_err(|e| load_err(e.to_string()))?;
    budget.check("loading it", need).map_err(over)?;
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
        if names.is_empty() {
            "(none)".to_string()
        } else {
            names.join(" ")
        }
    };

    let (eod_id, eod_token) = match eod {
        // Digits are an id: every byte-level vocabulary also has the token "0" ... "9", which
        // would otherwise end every document with a digit.
        Some(token) => match (token.bytes().all(|b| b.is_ascii_digit()), token.parse::<u64>()) {
            (true, Ok(id)) if id < vocab_size => {
                let id = id as u32;
                (id, tokenizer.id_to_token(id).unwrap_or_default())
            }
            (false, _) if tokenizer.token_to_id(token).is_some() => {
                (tokenizer.token_to_id(token).expect("a token"), token.to_string())
            }
            _ => {
                return Err(TokenizerError::UnknownEod {
                    token: token.to_string(),
                    path: path.to_path_buf(),
                    specials: special_list(),
                })
            }
        },
        None => {
            let config_err =
                |cfg: PathBuf, reason: String| TokenizerError::Config { path: cfg, reason, specials: special_list() };
            let configured = match config_eos_token(path).map_err(|(cfg, reason)| config_err(cfg, reason))? {
                Some((cfg, token)) => match tokenizer.token_to_id(&token) {
                    Some(id) => Some((id, token)),
                    None => {
                        let reason = format!(
                            "its eos_token {} is not a token of {}",
                            excerpt(&format!("{token:?}")),
                            path.display()
                        );
                        return Err(config_err(cfg, reason));
                    }
                },
                None => None,
            };
            let fallback = || {
                EOD_CANDIDATES
                    .iter()
                    .find_map(|c| specials.iter().find(|(_, s)| s == c).map(|(id, s)| (*id, s.clone())))
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

/// `eos_token` of the tokenizer_config.json beside `tokenizer_json`, as transformers reads it,
/// with the config's path. None when there is no config or it names no `eos_token` (then the
/// fallbacks or --eod decide). A config that is there but cannot be used (not a regular file,
/// linked out of the tokenizer's directory, too large, not JSON, an `eos_token` that is not a
/// string) is an error naming it: ignoring it would pick another end-of-document token silently.
fn config_eos_token(tokenizer_json: &Path) -> Result<Option<(PathBuf, String)>, (PathBuf, String)> {
    let dir = match tokenizer_json.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let named = dir.join("tokenizer_config.json");
    let cfg = match resolve_inside(dir, "tokenizer_config.json") {
        Ok(None) => return Ok(None),
        Ok(Some(cfg)) => cfg,
        Err(e) => return Err((named, e.to_string())),
    };
    let bytes = read_bounded(&cfg, MAX_CONFIG_BYTES).map_err(|e| (named.clone(), e.to_string()))?;
    eos_token_of_config(&bytes).map(|token| token.map(|t| (named.clone(), t))).map_err(|reason| (named, reason))
}

/// `eos_token` of a tokenizer_config.json document, as transformers reads it (a string, or an
/// added token's `content`); `None` if it names none. An error says why the document cannot be
/// read. Never panics (fuzzed).
pub fn eos_token_of_config(bytes: &[u8]) -> Result<Option<String>, String> {
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(format!("it is larger than {MAX_CONFIG_BYTES} bytes"));
    }
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| format!("it is not JSON ({})", excerpt(&e.to_string())))?;
    let Some(config) = value.as_object() else { return Err("it is not a JSON object".into()) };
    match config.get("eos_token") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Object(o)) => match o.get("content") {
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            _ => Err("its eos_token has no string `content`".into()),
        },
        Some(_) => Err("its eos_token is neither a string nor an added token".into()),
    }
}
