//! mflow's `dataset` stage: tokenizes text and JSONL corpora into Megatron-Core indexed datasets
//! (`train`/`valid`/`test` `.bin` + `.idx`), with `dataset.json`, `stats.json` and a copy of the
//! tokenizer.
//!
//! The binary calls [`cli::run`] with [`cli::DatasetArgs`]; at plan time it can check a spec's
//! options with [`Options::from_args`] (no file access) and [`Options::validate`] (loads the
//! tokenizer). Library users call [`build`] directly.

mod bpe;
pub mod build;
pub mod cli;
pub mod indexed;
pub mod input;
mod memo;
pub mod options;
pub mod output;
pub mod pretokenize;
pub mod split;
mod stream;
mod text_field;
pub mod tokenize;
mod untrusted;
mod words;

pub use build::{build, BuildError, Stats, Summary};
pub use cli::{run, DatasetArgs};
pub use options::{Options, OptionsError};
