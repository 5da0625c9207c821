//! What loading a tokenizer.json takes in memory, against its size and against mflow's estimate
//! (`mflow_data::tokenize::load_need`), as docs/validation.md records it.
//!
//! usage: tokenizer-memory make DIR       writes tokenizers of many shapes into DIR
//!        tokenizer-memory measure FILE   loads FILE as the dataset stage does (with the memory
//!                                        budget off) and prints one line: its size, its shape,
//!                                        the estimate, and the most heap and resident memory
//!                                        the load held
//! Run `measure` once per process: the peaks are the process's.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use serde_json::{json, Value};

/// The system allocator, counting what the process holds and the most it has held.
struct Counting;
static HELD: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is passed to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        PEAK.fetch_max(HELD.fetch_add(l.size(), Relaxed) + l.size(), Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        HELD.fetch_sub(l.size(), Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, size: usize) -> *mut u8 {
        if size > l.size() {
            PEAK.fetch_max(HELD.fetch_add(size - l.size(), Relaxed) + size - l.size(), Relaxed);
        } else {
            HELD.fetch_sub(l.size() - size, Relaxed);
        }
        unsafe { System.realloc(p, l, size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

fn status_kib(key: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with(key)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("make") => make(Path::new(&args[2])),
        Some("measure") => measure(Path::new(&args[2])),
        _ => eprintln!("usage: tokenizer-memory make DIR | measure FILE"),
    }
}

fn measure(path: &Path) {
    let bytes = std::fs::read(path).unwrap();
    let need = mflow_data::tokenize::load_need(&bytes).expect("a JSON document");
    let paths: [&[&str]; 3] = [&["model", "vocab"], &["model", "merges"], &["added_tokens"]];
    let (all, parts) = mflow_untrusted::json::shape_at(&bytes, &paths).unwrap();
    eprintln!("shape {all:?}\n vocab {:?}\n merges {:?}\n added {:?}", parts[0], parts[1], parts[2]);
    let size = bytes.len();
    drop(bytes);
    // Reset the resident peak (VmHWM) and the heap peak, then load as the stage does.
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let rss = status_kib("VmRSS:");
    let base = HELD.load(Relaxed);
    PEAK.store(base, Relaxed);
    let source = mflow_data::options::TokenizerSource::HfFile(path.into());
    std::env::set_var("MFLOW_MEMORY_BUDGET", "1024TiB");
    // With the word memo of one worker, whose splitter finds the added tokens.
    let loaded = mflow_data::tokenize::Encoder::load(&source, Some("0"), true).map(|e| e.with_word_memo(1, 1 << 20));
    let heap = PEAK.load(Relaxed) - base;
    let rss = (status_kib("VmHWM:") - rss) * 1024;
    let name = path.file_name().unwrap().to_string_lossy();
    println!(
        "{name}: {size} bytes; estimate {} ({:.1}x); held at most {heap} on the heap ({:.1}x), {rss} resident; {}; {}",
        need.total(),
        need.total() as f64 / size as f64,
        heap as f64 / size as f64,
        need.parts().iter().map(|(w, b)| format!("{w} = {b}")).collect::<Vec<_>>().join(", "),
        match loaded {
            Ok(_) => "loaded".to_string(),
            Err(e) => format!("refused: {}", mflow_untrusted::excerpt(&e.to_string())),
        }
    );
}

/// A small deterministic generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// The byte-level alphabet of GPT-2's tokenizers: 256 characters standing for the bytes.
fn byte_chars() -> Vec<String> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut n = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(256 + n);
            n += 1;
        }
    }
    printable.iter().map(|&c| char::from_u32(c).unwrap().to_string()).collect()
}

fn added(id: usize, content: &str, special: bool) -> Value {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
           "normalized": !special, "special": special})
}

/// A byte-level BPE of `vocab` tokens made by `vocab - 256` merges (as pairs, or as "a b"
/// strings), with `specials` added tokens.
fn bpe(vocab: usize, pairs: bool, specials: usize) -> Value {
    let mut tokens = byte_chars();
    let mut seen: std::collections::HashSet<String> = tokens.iter().cloned().collect();
    let mut merges = Vec::new();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    while tokens.len() < vocab {
        // Mostly short pieces, as in real vocabularies.
        let a = tokens[rng.next(tokens.len().min(2000))].clone();
        let b = tokens[rng.next(tokens.len())].clone();
        let t = format!("{a}{b}");
        if t.chars().count() > 16 || !seen.insert(t.clone()) {
            continue;
        }
        merges.push(if pairs { json!([a, b]) } else { json!(format!("{a} {b}")) });
        tokens.push(t);
    }
    let mut map = serde_json::Map::new();
    for (i, t) in tokens.iter().enumerate() {
        map.insert(t.clone(), i.into());
    }
    let added: Vec<Value> = (0..specials).map(|i| added(vocab + i, &format!("<|reserved_{i}|>"), true)).collect();
    let level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
           "pre_tokenizer": level, "post_processor": level, "decoder": level,
           "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                     "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                     "vocab": map, "merges": merges}})
}

fn words(n: usize, rng: &mut Rng) -> Vec<String> {
    let letters: Vec<char> = "abcdefghijklmnopqrstuvwxyzéüßøあ字".chars().collect();
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let len = 1 + rng.next(10);
        let w: String = (0..len).map(|_| letters[rng.next(letters.len())]).collect();
        if seen.insert(w.clone()) {
            out.push(w);
        }
    }
    out
}

fn make(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let write = |name: &str, v: &Value| std::fs::write(dir.join(name), serde_json::to_vec(v).unwrap()).unwrap();
    let mut rng = Rng(42);
    write("bpe-50k.json", &bpe(50_257, false, 1));
    write("bpe-128k-pairs.json", &bpe(128_000, true, 256));
    write("bpe-128k-strings.json", &bpe(128_000, false, 256));
    write("bpe-1m.json", &bpe(1_000_000, true, 0));
    let mut wp = serde_json::Map::new();
    for (i, w) in words(1_000_000, &mut rng).into_iter().enumerate() {
        wp.insert(w, i.into());
    }
    wp.insert("[UNK]".into(), 1_000_000.into());
    write(
        "wordpiece-1m.json",
        &json!({"version": "1.0", "truncation": null, "padding": null,
                "added_tokens": [added(1_000_000, "[UNK]", true)], "normalizer": null,
                "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
                "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                          "max_input_chars_per_word": 100, "vocab": wp}}),
    );
    let mut pieces: Vec<Value> = vec![json!(["<unk>", 0.0])];
    pieces.extend(words(1_000_000, &mut rng).into_iter().enumerate().map(|(i, w)| json!([w, -(i as f64) / 1e3])));
    write(
        "unigram-1m.json",
        &json!({"version": "1.0", "truncation": null, "padding": null,
                "added_tokens": [added(0, "<unk>", true)], "normalizer": null,
                "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true},
                "post_processor": null, "decoder": null,
                "model": {"type": "Unigram", "unk_id": 0, "vocab": pieces, "byte_fallback": false}}),
    );
    let mut wl = serde_json::Map::new();
    for (i, w) in words(2_000_000, &mut rng).into_iter().enumerate() {
        wl.insert(w, i.into());
    }
    wl.insert("[UNK]".into(), 2_000_000.into());
    write(
        "wordlevel-2m.json",
        &json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
                "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
                "model": {"type": "WordLevel", "unk_token": "[UNK]", "vocab": wl}}),
    );
    let mut many = bpe(1000, true, 0);
    let specials: Vec<Value> = (0..200_000).map(|i| added(1000 + i, &format!("<extra_{i}>"), i % 2 == 0)).collect();
    many["added_tokens"] = Value::Array(specials);
    write("added-200k.json", &many);
    let long: Vec<String> =
        (0..200_000).map(|_| (0..16 + rng.next(16)).map(|_| (b'a' + rng.next(26) as u8) as char).collect()).collect();
    let mut pieces: Vec<Value> = vec![json!(["<unk>", 0.0])];
    pieces.extend(long.iter().map(|w| json!([w, -1.0])));
    write(
        "unigram-long.json",
        &json!({"version": "1.0", "truncation": null, "padding": null,
                "added_tokens": [added(0, "<unk>", true)], "normalizer": null,
                "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true},
                "post_processor": null, "decoder": null,
                "model": {"type": "Unigram", "unk_id": 0, "vocab": pieces, "byte_fallback": false}}),
    );
    let mut long_added = bpe(1000, true, 0);
    let specials: Vec<Value> = (0..20_000)
        .map(|i| {
            let t: String = (0..500).map(|_| (b'a' + rng.next(26) as u8) as char).collect();
            added(1000 + i, &t, i % 2 == 0)
        })
        .collect();
    long_added["added_tokens"] = Value::Array(specials);
    write("added-long.json", &long_added);
    // Keys of the model it does not read are kept as a JSON value while it loads.
    let text = serde_json::to_string(&bpe(300, true, 0)).unwrap();
    let at = text.rfind("}}").unwrap();
    let deep = format!("[{}[]]", "[[[[[[[[[[]]]]]]]]]],".repeat(1_000_000));
    std::fs::write(dir.join("nested-in-model.json"), format!("{},\"junk\":{deep}}}}}", &text[..at])).unwrap();
}
