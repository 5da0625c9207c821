//! Benchmark ceiling: the `tokenizers` crate encoding a JSONL corpus that is already in memory,
//! with the same batches and rayon parallelism as the dataset build, and no output.
//!
//! usage: encode-ceiling CORPUS.jsonl TOKENIZER.json [THREADS] [BPE_CACHE_WORDS]
//! (BPE_CACHE_WORDS: the crate's default, 10,000 words per thread, when absent)

use std::io::BufRead;
use std::time::Instant;

use rayon::prelude::*;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (corpus, tok) = (&args[1], &args[2]);
    let threads: usize = args.get(3).map_or(0, |t| t.parse().expect("THREADS is a number"));
    let mut tokenizer = tokenizers::Tokenizer::from_file(tok).expect("tokenizer loads");
    if let Some(words) = args.get(4) {
        let mut model = tokenizer.get_model().clone();
        model.resize_cache(words.parse().expect("BPE_CACHE_WORDS is a number"));
        tokenizer.with_model(model);
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
            .map(|b| b.iter().map(|d| tokenizer.encode_fast(*d, true).unwrap().get_ids().len()).sum::<usize>())
            .sum()
    });
    let (secs, cpu) = (t1.elapsed().as_secs_f64(), cpu_seconds() - cpu1);
    let bytes: usize = docs.iter().map(|d| d.len()).sum();
    println!(
        "{{\"docs\": {}, \"text_bytes\": {}, \"tokens\": {}, \"load_s\": {:.2}, \"encode_s\": {:.2}, \"encode_cpu_s\": {:.2}, \"MBps\": {:.2}, \"Mtok_per_s\": {:.3}}}",
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
