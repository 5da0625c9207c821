//! Benchmark ceiling: the `tokenizers` crate encoding a JSONL corpus that is already in memory,
//! with the same batches and rayon parallelism as the dataset build, and no output.
//!
//! usage: encode-ceiling CORPUS.jsonl TOKENIZER.json [THREADS] [PATH]
//! PATH: `default` (the crate's `Tokenizer::encode_fast` with its default BPE cache of 10,000
//! words per thread; the ceiling), `cache:WORDS` (the same with the BPE cache resized), or
//! `memo` (mflow's encode path: `mflow_data::tokenize::Encoder` with its word memo).

use std::io::BufRead;
use std::time::Instant;

use rayon::prelude::*;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (corpus, tok) = (&args[1], &args[2]);
    let threads: usize = args.get(3).map_or(0, |t| t.parse().expect("THREADS is a number"));
    let path = args.get(4).map_or("default", String::as_str);
    let mut tokenizer = tokenizers::Tokenizer::from_file(tok).expect("tokenizer loads");
    let mut memo_encoder = None;
    match path.split_once(':') {
        _ if path == "default" => {}
        _ if path == "memo" => {
            let source = mflow_data::options::TokenizerSource::HfFile(tok.into());
            let workers =
                if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
            let encoder = mflow_data::tokenize::Encoder::load(&source, None, true).expect("tokenizer loads");
            let encoder = encoder.with_word_memo(workers, workers * (64 << 20));
            assert!(encoder.uses_word_memo(), "this tokenizer does not allow the word memo");
            memo_encoder = Some(encoder);
        }
        Some(("cache", words)) => {
            let mut model = tokenizer.get_model().clone();
            model.resize_cache(words.parse().expect("cache:WORDS takes a number"));
            tokenizer.with_model(model);
        }
        _ => panic!("PATH is default, cache:WORDS or memo, not {path:?}"),
    }

    let t0 = Instant::now();
    let file = std::io::BufReader::new(std::fs::File::open(corpus).expect("corpus opens"));
    let mut docs = Vec::new();
    for line in file.lines() {
        let line = line.expect("corpus reads");
        let v: serde_json::Value = serde_json::from_str(&line).expect("valid JSONL");
        docs.push(v["text"].as_str().expect("text field").to_string());
    }
    let load_s = t0.elapsed().as_secs_f64();
    // batches of ~1 MiB, as the dataset build cuts them
    let mut batches: Vec<Vec<&str>> = vec![Vec::new()];
    let mut size = 0;
    for d in &docs {
        batches.last_mut().unwrap().push(d);
        size += d.len();
        if size >= 1 << 20 {
            batches.push(Vec::new());
            size = 0;
        }
    }
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    let (t1, cpu1) = (Instant::now(), cpu_seconds());
    let tokens: usize = pool.install(|| {
        batches
            .par_iter()
            .map(|b| match &memo_encoder {
                // without the end-of-document id, as for the crate's path
                Some(enc) => {
                    let mut ids = Vec::new();
                    b.iter()
                        .map(|d| {
                            ids.clear();
                            enc.encode_into(d, None, &mut ids).unwrap();
                            ids.len() - 1
                        })
                        .sum::<usize>()
                }
                None => b.iter().map(|d| tokenizer.encode_fast(*d, true).unwrap().get_ids().len()).sum::<usize>(),
            })
            .sum()
    });
    let (secs, cpu) = (t1.elapsed().as_secs_f64(), cpu_seconds() - cpu1);
    let bytes: usize = docs.iter().map(|d| d.len()).sum();
    println!(
        "{{\"path\": \"{path}\", \"docs\": {}, \"text_bytes\": {}, \"tokens\": {}, \"load_s\": {:.2}, \"encode_s\": {:.2}, \"encode_cpu_s\": {:.2}, \"MBps\": {:.2}, \"Mtok_per_s\": {:.3}}}",
        docs.len(), bytes, tokens, load_s, secs, cpu, bytes as f64 / 1e6 / secs, tokens as f64 / 1e6 / secs
    );
}

/// User + system CPU seconds of this process so far (Linux /proc; 0 elsewhere).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // fields after the parenthesised command name; utime and stime are the 12th and 13th
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = rest.split_whitespace().skip(11).take(2).filter_map(|x| x.parse().ok()).collect();
    f.iter().sum::<f64>() / 100.0
}
