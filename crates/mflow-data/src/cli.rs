//! Command-line surface of the `dataset` stage (`mflow dataset ...`).

use std::path::PathBuf;

use crate::build::build;
use crate::options::{DtypeChoice, InputFormat, InvalidUtf8, Options, SplitBy};

/// Tokenize text or JSONL into Megatron indexed datasets (train/valid/test .bin/.idx).
#[derive(clap::Args, Debug, Clone)]
pub struct DatasetArgs {
    /// input files or globs (plain text or JSONL, optionally .gz / .zst compressed)
    pub inputs: Vec<String>,
    /// tokenizer.json path, an HF model directory holding tokenizer.json, or "byte-level"
    #[arg(long)]
    pub tokenizer: String,
    /// output directory; written whole or not at all
    #[arg(long)]
    pub out: PathBuf,
    /// input format
    #[arg(long, value_enum, default_value = "auto")]
    pub format: InputFormat,
    /// how plain-text files are cut into documents [default: file]
    #[arg(long, value_enum)]
    pub split_by: Option<SplitBy>,
    /// JSONL field holding the document text
    #[arg(long, default_value = "text")]
    pub text_key: String,
    /// train,valid,test weights; documents are assigned deterministically for --seed
    #[arg(long, default_value = "98,1,1")]
    pub splits: String,
    /// seed of the train/valid/test assignment
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// cut documents to at most this many tokens (the end-of-document token comes on top)
    #[arg(long)]
    pub max_doc_tokens: Option<u64>,
    /// refuse documents larger than this many bytes [default: 256 MiB]
    #[arg(long)]
    pub max_doc_bytes: Option<u64>,
    /// token dtype of the .bin files
    #[arg(long, value_enum, default_value = "auto")]
    pub dtype: DtypeChoice,
    /// what to do with a document that is not valid UTF-8
    #[arg(long, value_enum, default_value = "skip")]
    pub on_invalid_utf8: InvalidUtf8,
    /// worker threads, 1 to 1024 [default: one per core]
    #[arg(long, value_parser = thread_count)]
    pub threads: Option<usize>,
    /// end-of-document token (string or id) [default: the tokenizer's eos token]
    #[arg(long)]
    pub eod: Option<String>,
    /// do not add the tokenizer's special tokens (e.g. BOS) around each document
    #[arg(long)]
    pub no_special_tokens: bool,
    /// memory cap in MiB of each thread's word memo (ids of words already seen); 0 encodes
    /// every document with the tokenizer's own `encode`. The ids are the same either way.
    #[arg(long, default_value_t = 64)]
    pub word_memo_mib: u64,
}

/// Threads beyond the cores only add memos and queues; a thousand is past any machine's use.
fn thread_count(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n @ 1..=1024) => Ok(n),
        _ => Err(format!("`{s}` is not a number of threads from 1 to 1024")),
    }
}

/// Runs the stage: tokenizes the corpus into `--out` and prints a one-line summary.
pub fn run(args: &DatasetArgs) -> miette::Result<()> {
    let opts = Options::from_args(args)?;
    let summary = build(&opts)?;
    let s = &summary.stats;
    let secs = summary.seconds.max(1e-9);
    eprintln!(
        "dataset {}: {} documents, {} tokens (train {}, valid {}, test {} documents), {:.1} MB/s, {:.2} M tokens/s, {} threads, {}",
        opts.out.display(),
        s.documents,
        s.tokens,
        s.splits["train"].documents,
        s.splits["valid"].documents,
        s.splits["test"].documents,
        s.text_bytes as f64 / 1e6 / secs,
        s.tokens as f64 / 1e6 / secs,
        summary.threads,
        summary.path,
    );
    Ok(())
}
