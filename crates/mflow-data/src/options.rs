//! Parsed and checked options of the `dataset` stage. [`Options::from_args`] touches no file, so
//! mflow can check a spec at plan time; [`Options::validate`] also loads the tokenizer to check
//! the end-of-document token and the dtype before any corpus is read.

use std::path::PathBuf;

use miette::Diagnostic;
use thiserror::Error;

use crate::cli::DatasetArgs;
use crate::indexed::Dtype;
use crate::split::{SplitError, SplitRatios};
use crate::tokenize::{Encoder, TokenizerError};

/// Largest document accepted unless `--max-doc-bytes` says otherwise.
pub const DEFAULT_MAX_DOC_BYTES: u64 = 256 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum InputFormat {
    /// `.jsonl`/`.json`/`.ndjson` (optionally `.gz`/`.zst`) is JSONL, everything else text
    Auto,
    Text,
    Jsonl,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SplitBy {
    /// each text file is one document
    File,
    /// each non-blank line is one document
    Line,
    /// paragraphs separated by blank lines are documents
    BlankLine,
}

impl SplitBy {
    /// The value as written after `--split-by`.
    pub fn name(self) -> String {
        clap::ValueEnum::to_possible_value(&self).map(|v| v.get_name().to_string()).unwrap_or_default()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DtypeChoice {
    /// uint16 when the vocabulary has fewer than 65,500 entries (Megatron's rule), else int32
    Auto,
    Uint16,
    Int32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum InvalidUtf8 {
    /// skip the document and count it in stats.json
    Skip,
    /// stop with an error naming the file and line
    Fail,
}

/// Where token ids come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerSource {
    /// A `tokenizer.json` file (a directory argument is resolved to the file inside it).
    HfFile(PathBuf),
    /// Raw UTF-8 bytes as ids 0..=255, end of document 256.
    ByteLevel,
}

#[derive(Debug, Error, Diagnostic)]
pub enum OptionsError {
    #[error("no input given")]
    #[diagnostic(
        code(mflow::data::options::no_inputs),
        help("name at least one input file or glob, e.g. 'corpus/*.jsonl'")
    )]
    NoInputs,

    #[error("--text-key is empty")]
    #[diagnostic(
        code(mflow::data::options::text_key),
        help("name the JSON field holding the document text, e.g. --text-key text")
    )]
    EmptyTextKey,

    #[error("--{flag} must be at least 1")]
    #[diagnostic(code(mflow::data::options::zero), help("leave --{flag} out for no limit / the default"))]
    Zero { flag: &'static str },

    #[error("--split-by {split_by} applies to text input only, but --format is jsonl")]
    #[diagnostic(
        code(mflow::data::options::split_by_jsonl),
        help("JSONL has one document per line; drop --split-by or use --format text")
    )]
    SplitByWithJsonl { split_by: String },

    #[error("--eod cannot be used with the byte-level tokenizer")]
    #[diagnostic(
        code(mflow::data::options::byte_level_eod),
        help("byte-level ids are 0..=255 and the end-of-document id is always 256; drop --eod")
    )]
    ByteLevelEod,

    #[error("tokenizer path {path} is neither a tokenizer.json file nor a directory holding one")]
    #[diagnostic(
        code(mflow::data::options::tokenizer_path),
        help("pass a tokenizer.json, a Hugging Face model directory that contains tokenizer.json, or \"byte-level\"")
    )]
    TokenizerPath { path: PathBuf },

    #[error("the vocabulary ({vocab_size} ids) does not fit --dtype {dtype}, which holds ids below {limit}")]
    #[diagnostic(code(mflow::data::options::dtype), help("use --dtype int32 (or --dtype auto)"))]
    DtypeTooSmall { vocab_size: u64, dtype: &'static str, limit: u64 },

    #[error(transparent)]
    #[diagnostic(transparent)]
    Split(#[from] SplitError),

    #[error(transparent)]
    #[diagnostic(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// Everything the dataset build needs, in checked form.
#[derive(Debug, Clone)]
pub struct Options {
    pub inputs: Vec<String>,
    pub tokenizer: TokenizerSource,
    pub out: PathBuf,
    pub format: InputFormat,
    pub split_by: SplitBy,
    pub text_key: String,
    pub splits: SplitRatios,
    pub seed: u64,
    pub max_doc_tokens: Option<u64>,
    pub max_doc_bytes: u64,
    pub dtype: DtypeChoice,
    pub on_invalid_utf8: InvalidUtf8,
    /// Worker threads; 0 means one per core.
    pub threads: usize,
    pub eod: Option<String>,
    pub add_special_tokens: bool,
    /// Cap of each worker's word memo in MiB; 0 turns the memo off.
    pub word_memo_mib: u64,
}

impl Options {
    /// Checks the arguments without touching any file.
    pub fn from_args(args: &DatasetArgs) -> Result<Options, OptionsError> {
        if args.inputs.is_empty() {
            return Err(OptionsError::NoInputs);
        }
        if args.text_key.is_empty() {
            return Err(OptionsError::EmptyTextKey);
        }
        if args.max_doc_tokens == Some(0) {
            return Err(OptionsError::Zero { flag: "max-doc-tokens" });
        }
        if args.max_doc_bytes == Some(0) {
            return Err(OptionsError::Zero { flag: "max-doc-bytes" });
        }
        if let (InputFormat::Jsonl, Some(s)) = (args.format, args.split_by) {
            if s != SplitBy::File {
                return Err(OptionsError::SplitByWithJsonl { split_by: s.name() });
            }
        }
        let tokenizer = if args.tokenizer == "byte-level" {
            if args.eod.is_some() {
                return Err(OptionsError::ByteLevelEod);
            }
            TokenizerSource::ByteLevel
        } else {
            TokenizerSource::HfFile(PathBuf::from(&args.tokenizer))
        };
        Ok(Options {
            inputs: args.inputs.clone(),
            tokenizer,
            out: args.out.clone(),
            format: args.format,
            split_by: args.split_by.unwrap_or(SplitBy::File),
            text_key: args.text_key.clone(),
            splits: SplitRatios::parse(&args.splits)?,
            seed: args.seed,
            max_doc_tokens: args.max_doc_tokens,
            max_doc_bytes: args.max_doc_bytes.unwrap_or(DEFAULT_MAX_DOC_BYTES),
            dtype: args.dtype,
            on_invalid_utf8: args.on_invalid_utf8,
            threads: args.threads.unwrap_or(0),
            eod: args.eod.clone(),
            add_special_tokens: !args.no_special_tokens,
            word_memo_mib: args.word_memo_mib,
        })
    }

    /// Loads the tokenizer and checks the end-of-document token and the dtype; returns the
    /// encoder the build will use.
    pub fn validate(&self) -> Result<Encoder, OptionsError> {
        let source = match &self.tokenizer {
            // A model directory's tokenizer.json must resolve inside it, like its other files.
            TokenizerSource::HfFile(p) if p.is_dir() && p.join("tokenizer.json").is_file() => {
                match crate::untrusted::resolve_inside(p, "tokenizer.json") {
                    Ok(_) => TokenizerSource::HfFile(p.join("tokenizer.json")),
                    Err(e) => {
                        let path = p.join("tokenizer.json");
                        return Err(TokenizerError::Load { path, message: e.to_string() }.into());
                    }
                }
            }
            TokenizerSource::HfFile(p) if !p.is_file() => {
                return Err(match std::fs::metadata(p) {
                    // Say what is there: a FIFO or device is never read (it could block).
                    Ok(m) if !m.is_dir() => {
                        let message = crate::untrusted::not_regular(m.file_type()).to_string();
                        TokenizerError::Load { path: p.clone(), message }.into()
                    }
                    _ => OptionsError::TokenizerPath { path: p.clone() },
                });
            }
            other => other.clone(),
        };
        let encoder = Encoder::load(&source, self.eod.as_deref(), self.add_special_tokens)?;
        let dtype = self.resolve_dtype(encoder.vocab_size())?;
        Ok(encoder.with_dtype(dtype))
    }

    fn resolve_dtype(&self, vocab_size: u64) -> Result<Dtype, OptionsError> {
        let dtype = match self.dtype {
            DtypeChoice::Auto => Dtype::optimal(vocab_size),
            DtypeChoice::Uint16 => Dtype::Uint16,
            DtypeChoice::Int32 => Dtype::Int32,
        };
        if vocab_size > dtype.id_limit() {
            return Err(OptionsError::DtypeTooSmall { vocab_size, dtype: dtype.name(), limit: dtype.id_limit() });
        }
        Ok(dtype)
    }
}
