//! The estimate of what loading a tokenizer.json holds (`tokenize::load_need`) against what
//! loading it really holds, counted by this test binary's allocator, for tokenizers of every
//! model type and of the shapes that cost the most per byte: BPE with pair merges, a Unigram
//! of pieces that share no prefix, long added tokens, and arrays nested in the model. The
//! estimate must never be below what was held, nor far above it. docs/validation.md has the
//! same comparison at full size (the example `tokenizer-memory`).

use std::path::Path;

use mflow_data::options::TokenizerSource;
use mflow_data::tokenize::{load_need, Encoder};
use mflow_untrusted::counting::{peak_of, Counting};
use serde_json::{json, Value};

#[global_allocator]
static COUNTING: Counting = Counting;

struct Rng(u64);

impl Rng {
    fn next(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
    fn word(&mut self, len: usize) -> String {
        (0..len).map(|_| (b'a' + self.next(26) as u8) as char).collect()
    }
}

fn added(id: usize, content: &str, special: bool) -> Value {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
           "normalized": !special, "special": special})
}

fn pipeline(model: Value, added_tokens: Vec<Value>, pre_tokenizer: Value) -> Value {
    json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": added_tokens,
           "normalizer": null, "pre_tokenizer": pre_tokenizer, "post_processor": null, "decoder": null,
           "model": model})
}

/// A BPE over the letters of `vocab` tokens, its merges as pairs or as "a b" strings.
fn bpe(vocab: usize, pairs: bool, rng: &mut Rng) -> Value {
    let mut tokens: Vec<String> = (b'a'..=b'z').map(|c| (c as char).to_string()).collect();
    let mut seen: std::collections::HashSet<String> = tokens.iter().cloned().collect();
    let mut merges = Vec::new();
    while tokens.len() < vocab {
        let a = tokens[rng.next(tokens.len().min(500))].clone();
        let b = tokens[rng.next(tokens.len())].clone();
        let t = format!("{a}{b}");
        if t.len() > 16 || !seen.insert(t.clone()) {
            continue;
        }
        merges.push(if pairs { json!([a, b]) } else { json!(format!("{a} {b}")) });
        tokens.push(t);
    }
    let vocab: serde_json::Map<String, Value> = tokens.into_iter().enumerate().map(|(i, t)| (t, i.into())).collect();
    json!({"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
           "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
           "vocab": vocab, "merges": merges})
}

fn shapes() -> Vec<(&'static str, Value)> {
    let mut rng = Rng(7);
    let whitespace = json!({"type": "Whitespace"});
    let mut v = vec![
        (
            "bpe, pair merges",
            pipeline(bpe(20_000, true, &mut rng), vec![added(20_000, "<s>", true)], whitespace.clone()),
        ),
        ("bpe, string merges", pipeline(bpe(20_000, false, &mut rng), vec![], whitespace.clone())),
    ];
    let words: serde_json::Map<String, Value> =
        (0..50_000).map(|i| (format!("{}{i}", rng.word(5)), i.into())).collect();
    let mut wordpiece = words.clone();
    wordpiece.insert("[UNK]".into(), 50_000.into());
    v.push((
        "wordpiece",
        pipeline(
            json!({"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                   "max_input_chars_per_word": 100, "vocab": wordpiece}),
            vec![added(50_000, "[UNK]", true)],
            whitespace.clone(),
        ),
    ));
    let mut wordlevel = words;
    wordlevel.insert("[UNK]".into(), 50_000.into());
    v.push((
        "wordlevel",
        pipeline(json!({"type": "WordLevel", "unk_token": "[UNK]", "vocab": wordlevel}), vec![], whitespace.clone()),
    ));
    let mut pieces = vec![json!(["<unk>", 0.0])];
    pieces.extend((0..20_000).map(|_| json!([rng.word(24), -1.0])));
    v.push((
        "unigram of pieces sharing no prefix",
        pipeline(
            json!({"type": "Unigram", "unk_id": 0, "vocab": pieces, "byte_fallback": false}),
            vec![added(0, "<unk>", true)],
            json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true}),
        ),
    ));
    let long: Vec<Value> = (0..2000).map(|i| added(300 + i, &rng.word(500), i % 2 == 0)).collect();
    v.push(("long added tokens", pipeline(bpe(300, true, &mut rng), long, whitespace.clone())));
    let mut junk = bpe(300, true, &mut rng);
    junk["junk"] = serde_json::from_str(&format!("[{}[]]", "[[[[[[[[[[]]]]]]]]]],".repeat(10_000))).unwrap();
    v.push(("arrays nested in the model", pipeline(junk, vec![], whitespace)));
    v
}

fn load(path: &Path) -> Encoder {
    Encoder::load(&TokenizerSource::HfFile(path.into()), Some("0"), true).unwrap().with_word_memo(1, 1 << 20)
}

#[test]
fn the_estimate_bounds_what_loading_holds() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, tokenizer) in shapes() {
        let path = tmp.path().join("tokenizer.json");
        let bytes = serde_json::to_vec(&tokenizer).unwrap();
        std::fs::write(&path, &bytes).unwrap();
        let estimate = load_need(&bytes).unwrap().total();
        drop((bytes, tokenizer));
        let (encoder, held) = peak_of(|| load(&path));
        drop(encoder);
        let size = std::fs::metadata(&path).unwrap().len();
        eprintln!("{name}: {size} bytes, held {held} ({:.1}x), estimate {estimate}", held as f64 / size as f64);
        assert!(held <= estimate, "{name}: held {held}, estimated {estimate}");
        assert!(estimate <= 3 * held, "{name}: held {held}, estimated {estimate}");
    }
}
