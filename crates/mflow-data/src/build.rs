//! The tokenization pipeline: one thread reads documents and cuts them into batches, a rayon
//! pool encodes batches (several in flight, so a huge document stalls only its own batch),
//! and the calling thread writes finished batches in corpus order. Output bytes therefore do
//! not depend on the thread count, and memory is bounded by the number of batches in flight.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, SyncSender};
use std::sync::Arc;
use std::time::Instant;

use mflow_progress::Reporter;
use miette::Diagnostic;
use serde::Serialize;
use thiserror::Error;

use crate::indexed::{IndexedError, IndexedWriter};
use crate::input::{self, Doc, DocReader, InputError, ReaderOptions, Skipped};
use crate::options::{Options, OptionsError};
use crate::output::{OutputError, Staging};
use crate::split::{SplitAssigner, SPLIT_NAMES};
use crate::tokenize::{Encoder, TokenizerError};

/// A batch is cut once it holds this much text or this many documents.
const BATCH_BYTES: usize = 1 << 20;
const BATCH_DOCS: usize = 2048;
/// Batches encoded or waiting to be written, per worker thread.
const IN_FLIGHT_PER_THREAD: usize = 16;

#[derive(Debug, Error, Diagnostic)]
pub enum BuildError {
    #[error(transparent)]
    #[diagnostic(transparent)]
    Options(#[from] OptionsError),

    #[error(transparent)]
    #[diagnostic(transparent)]
    Input(#[from] InputError),

    #[error(transparent)]
    #[diagnostic(transparent)]
    Indexed(#[from] IndexedError),

    #[error(transparent)]
    #[diagnostic(transparent)]
    Output(#[from] OutputError),

    #[error("{path}:{line}: cannot tokenize the document")]
    #[diagnostic(
        code(mflow::data::build::encode),
        help("the tokenizer rejected this document; check the tokenizer and the input text")
    )]
    Encode {
        path: PathBuf,
        line: u64,
        #[source]
        source: TokenizerError,
    },

    #[error("the corpus has no documents ({files} files read, {invalid_utf8} documents skipped as invalid UTF-8, {empty} empty)")]
    #[diagnostic(
        code(mflow::data::build::empty_corpus),
        help("check the input globs, --format, --split-by and --text-key")
    )]
    EmptyCorpus { files: usize, invalid_utf8: u64, empty: u64 },

    #[error("no document went to the train split ({documents} documents, --splits weights {ratios:?})")]
    #[diagnostic(
        code(mflow::data::build::empty_train),
        help("give train a larger weight in --splits, or add documents")
    )]
    EmptyTrain { documents: u64, ratios: [f64; 3] },

    #[error("cannot start {threads} worker threads: {message}")]
    #[diagnostic(code(mflow::data::build::threads), help("lower --threads"))]
    Threads { threads: usize, message: String },

    #[error("cannot write {path}: {source}")]
    #[diagnostic(code(mflow::data::build::io), help("check that the output filesystem is writable and not full"))]
    Io { path: PathBuf, source: std::io::Error },
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct SplitStats {
    pub documents: u64,
    pub tokens: u64,
    pub text_bytes: u64,
}

/// Written as stats.json. Holds no timings, so that equal inputs give equal bytes.
#[derive(Debug, Clone, Serialize)]
pub struct Stats {
    pub files: u64,
    pub bytes_read: u64,
    pub documents: u64,
    pub tokens: u64,
    pub text_bytes: u64,
    pub truncated_documents: u64,
    pub skipped: Skipped,
    pub splits: Splits,
}

/// Per-split counts, in train / valid / test order.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Splits {
    pub train: SplitStats,
    pub valid: SplitStats,
    pub test: SplitStats,
}

impl Splits {
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &SplitStats)> {
        SPLIT_NAMES.into_iter().zip([&self.train, &self.valid, &self.test])
    }
}

impl std::ops::Index<&str> for Splits {
    type Output = SplitStats;
    fn index(&self, name: &str) -> &SplitStats {
        match name {
            "train" => &self.train,
            "valid" => &self.valid,
            "test" => &self.test,
            other => panic!("no split named {other}"),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Summary {
    pub stats: Stats,
    pub seconds: f64,
    pub threads: usize,
    /// How documents were encoded ([`Encoder::path`]).
    pub path: String,
}

struct Batch {
    seq: u64,
    docs: Vec<(Doc, u8)>,
}

#[derive(Default)]
struct Encoded {
    seq: u64,
    bytes: [Vec<u8>; 3],
    lengths: [Vec<u32>; 3],
    text_bytes: [u64; 3],
    truncated: u64,
    failure: Option<(u32, u64, TokenizerError)>,
}

/// Checks the options, tokenizes the corpus and commits the dataset directory. Progress goes
/// to `MFLOW_PROGRESS` (or a terminal bar) in input bytes.
pub fn build(opts: &Options) -> Result<Summary, BuildError> {
    let started = Instant::now();
    let threads =
        if opts.threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { opts.threads };
    let memo_bytes = usize::try_from(opts.word_memo_mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX);
    let files = input::expand(&opts.inputs, opts.format)?;
    let total_bytes: u64 = files.iter().map(|f| f.bytes).sum();
    // The reader starts first: it reads ahead (as many batches as may be in flight) while the
    // tokenizer loads, which takes a tenth of a second or more.
    let bytes_read = Arc::new(AtomicU64::new(0));
    let max_in_flight = threads * IN_FLIGHT_PER_THREAD;
    let (batch_tx, batch_rx) = sync_channel::<Result<Batch, InputError>>(max_in_flight);
    let reader = spawn_reader(files.clone(), opts, bytes_read.clone(), batch_tx)?;
    let encoder = Arc::new(opts.validate()?.with_word_memo(threads, threads.saturating_mul(memo_bytes)));
    let reporter = Reporter::new("tokenize", Some(total_bytes), "bytes");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("mflow-tokenize-{i}"))
        .build()
        .map_err(|e| BuildError::Threads { threads, message: e.to_string() })?;

    let staging = Staging::create(&opts.out)?;
    let mut writers = Vec::new();
    for name in SPLIT_NAMES {
        writers.push(IndexedWriter::create(&staging.path().join(name), encoder.dtype())?);
    }

    let mut splits = [SplitStats::default(), SplitStats::default(), SplitStats::default()];
    let mut truncated = 0;
    let (done_tx, done_rx) = channel::<Encoded>();
    let (mut in_flight, mut next_seq, mut reader_done) = (0usize, 0u64, false);
    let mut pending = BTreeMap::new();
    loop {
        while !reader_done && in_flight < max_in_flight {
            match batch_rx.recv() {
                Ok(Ok(batch)) => {
                    in_flight += 1;
                    let (encoder, done_tx, max_tokens) = (encoder.clone(), done_tx.clone(), opts.max_doc_tokens);
                    pool.spawn(move || {
                        let _ = done_tx.send(encode_batch(&encoder, batch, max_tokens));
                    });
                }
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => reader_done = true,
            }
        }
        if in_flight == 0 {
            break;
        }
        let encoded = done_rx.recv().expect("workers hold a sender while batches are in flight");
        pending.insert(encoded.seq, encoded);
        while let Some(mut encoded) = pending.remove(&next_seq) {
            in_flight -= 1;
            next_seq += 1;
            if let Some((file, line, source)) = encoded.failure.take() {
                return Err(BuildError::Encode { path: files[file as usize].path.clone(), line, source });
            }
            for (s, writer) in writers.iter_mut().enumerate() {
                writer.append(&encoded.bytes[s], &encoded.lengths[s])?;
                splits[s].documents += encoded.lengths[s].len() as u64;
                splits[s].tokens += encoded.lengths[s].iter().map(|&n| n as u64).sum::<u64>();
                splits[s].text_bytes += encoded.text_bytes[s];
            }
            truncated += encoded.truncated;
            report(&reporter, &bytes_read, &splits, started);
        }
    }
    let skipped = reader.join().expect("the reader thread does not panic");
    report(&reporter, &bytes_read, &splits, started);
    reporter.finish();

    let documents: u64 = splits.iter().map(|s| s.documents).sum();
    if documents == 0 {
        return Err(BuildError::EmptyCorpus {
            files: files.len(),
            invalid_utf8: skipped.invalid_utf8,
            empty: skipped.empty,
        });
    }
    if splits[0].documents == 0 {
        return Err(BuildError::EmptyTrain { documents, ratios: opts.splits.0 });
    }
    for w in writers {
        if w.documents() == 0 {
            w.discard()?;
        } else {
            w.finish()?;
        }
    }
    let stats = Stats {
        files: files.len() as u64,
        bytes_read: total_bytes,
        documents,
        tokens: splits.iter().map(|s| s.tokens).sum(),
        text_bytes: splits.iter().map(|s| s.text_bytes).sum(),
        truncated_documents: truncated,
        skipped,
        splits: {
            let [train, valid, test] = splits;
            Splits { train, valid, test }
        },
    };
    write_metadata(staging.path(), opts, &encoder, &stats)?;
    staging.commit()?;
    Ok(Summary { stats, seconds: started.elapsed().as_secs_f64(), threads, path: encoder.path() })
}

/// Starts the thread that reads the corpus in order, assigns each document its split and sends
/// the documents in batches; it returns what it skipped.
fn spawn_reader(
    files: Vec<input::InputFile>,
    opts: &Options,
    bytes_read: Arc<AtomicU64>,
    batch_tx: SyncSender<Result<Batch, InputError>>,
) -> Result<std::thread::JoinHandle<Skipped>, BuildError> {
    let ropts = ReaderOptions {
        split_by: opts.split_by,
        text_key: opts.text_key.clone(),
        on_invalid_utf8: opts.on_invalid_utf8,
        max_doc_bytes: opts.max_doc_bytes,
    };
    let mut assigner = SplitAssigner::new(&opts.splits, opts.seed);
    std::thread::Builder::new()
        .name("mflow-read".into())
        .spawn(move || {
            let mut reader = DocReader::new(files, ropts, bytes_read);
            let mut batch = Batch { seq: 0, docs: Vec::new() };
            let mut batch_bytes = 0;
            loop {
                let doc = match reader.next_doc() {
                    Ok(Some(doc)) => doc,
                    Ok(None) => break,
                    Err(e) => {
                        let _ = batch_tx.send(Err(e));
                        return reader.skipped;
                    }
                };
                batch_bytes += doc.text.len();
                batch.docs.push((doc, assigner.next_split()));
                if batch_bytes >= BATCH_BYTES || batch.docs.len() >= BATCH_DOCS {
                    let next = Batch { seq: batch.seq + 1, docs: Vec::new() };
                    if batch_tx.send(Ok(std::mem::replace(&mut batch, next))).is_err() {
                        return reader.skipped;
                    }
                    batch_bytes = 0;
                }
            }
            if !batch.docs.is_empty() {
                let _ = batch_tx.send(Ok(batch));
            }
            reader.skipped
        })
        .map_err(|e| BuildError::Threads { threads: 1, message: e.to_string() })
}

fn encode_batch(encoder: &Encoder, batch: Batch, max_tokens: Option<u64>) -> Encoded {
    let mut out = Encoded { seq: batch.seq, ..Encoded::default() };
    let mut ids = Vec::new();
    for (doc, split) in batch.docs {
        let s = split as usize;
        ids.clear();
        match encoder.encode_into(&doc.text, max_tokens, &mut ids) {
            Ok(cut) => out.truncated += cut as u64,
            Err(e) => {
                out.failure = Some((doc.file, doc.line, e));
                return out;
            }
        }
        encoder.dtype().extend_bytes(&ids, &mut out.bytes[s]);
        out.lengths[s].push(ids.len() as u32);
        out.text_bytes[s] += doc.text.len() as u64;
    }
    out
}

fn report(reporter: &Reporter, bytes_read: &AtomicU64, splits: &[SplitStats; 3], started: Instant) {
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    let text: u64 = splits.iter().map(|s| s.text_bytes).sum();
    let tokens: u64 = splits.iter().map(|s| s.tokens).sum();
    reporter.message(format!("{:.1} MB/s, {:.2} M tokens/s", text as f64 / 1e6 / secs, tokens as f64 / 1e6 / secs));
    reporter.set(bytes_read.load(Ordering::Relaxed));
}

#[derive(Serialize)]
struct DatasetJson<'a> {
    format: &'static str,
    version: u32,
    vocab_size: u64,
    eod_id: u32,
    eod_token: &'a str,
    dtype: &'static str,
    /// Only the splits that hold documents; an empty split has no files.
    splits: serde_json::Map<String, serde_json::Value>,
    tokenizer: &'static str,
    add_special_tokens: bool,
    split_ratios: [f64; 3],
    seed: u64,
    max_doc_tokens: Option<u64>,
}

fn write_metadata(dir: &Path, opts: &Options, encoder: &Encoder, stats: &Stats) -> Result<(), BuildError> {
    let write = |name: &str, bytes: Vec<u8>| {
        let path = dir.join(name);
        std::fs::write(&path, bytes).map_err(|source| BuildError::Io { path, source })
    };
    let meta = DatasetJson {
        format: "mflow-dataset",
        version: 1,
        vocab_size: encoder.vocab_size(),
        eod_id: encoder.eod(),
        eod_token: encoder.eod_token(),
        dtype: encoder.dtype().name(),
        splits: stats
            .splits
            .iter()
            .filter(|(_, s)| s.documents > 0)
            .map(|(k, v)| (k.to_string(), serde_json::to_value(v).expect("plain data")))
            .collect(),
        tokenizer: if encoder.tokenizer_file().is_some() { "tokenizer.json" } else { "byte-level" },
        add_special_tokens: encoder.add_special_tokens(),
        split_ratios: opts.splits.0,
        seed: opts.seed,
        max_doc_tokens: opts.max_doc_tokens,
    };
    write("dataset.json", pretty(&meta))?;
    write("stats.json", pretty(stats))?;
    if let Some(src) = encoder.tokenizer_file() {
        let path = dir.join("tokenizer.json");
        std::fs::copy(src, &path).map_err(|source| BuildError::Io { path, source })?;
    }
    Ok(())
}

fn pretty<T: Serialize>(value: &T) -> Vec<u8> {
    let mut v = serde_json::to_vec_pretty(value).expect("plain data serializes");
    v.push(b'\n');
    v
}
