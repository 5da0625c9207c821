//! mflow's own pre-tokenizer cuts every text as the `tokenizers` crate's pre-tokenizer does, and
//! datasets built through it hold the ids of the Python `tokenizers` library (read back with
//! Megatron's reader): odd Unicode (every code point, unassigned and newly assigned ones,
//! combining marks, emoji sequences), special tokens inside words, documents large enough to be
//! encoded in pieces, invalid UTF-8 skipped as before; 1, 2 and 4 threads byte-identical.

mod common;

use std::path::Path;

use common::*;
use mflow_data::pretokenize::{crate_words, ByteLevelSplitter};
use serde_json::json;
use tokenizers::Tokenizer;

const GPT2: &str = "tests/fixtures/tokenizer/tokenizer.json";
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's pattern: one digit at a time. Not one the scanner knows: the regex path runs.
const QWEN2_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Pieces of text that exercise each alternative of the patterns and the character tables.
const PIECES: &[&str] = &[
    "a",
    "Z",
    "hello",
    " the",
    "x",
    "7",
    "123",
    "4567",
    " 89",
    "½",
    "١٢٣",
    "Ⅻ",
    "𝟘",
    " ",
    "  ",
    "\t",
    "\n",
    "\r\n",
    "\r",
    "\n\n",
    "\u{a0}",
    "\u{3000}",
    "\u{85}",
    "\u{2028}",
    "\u{200b}",
    "\u{feff}",
    "\u{b}",
    "\u{c}",
    ".",
    "...",
    ",",
    "(",
    ")",
    "{",
    "->",
    "::",
    "'",
    "'s",
    "'t",
    "'re",
    "'ve",
    "'m",
    "'ll",
    "'d",
    "'S",
    "'LL",
    "'Re",
    "'ſ",
    "ſ",
    "'x",
    "\"",
    "é",
    "e\u{301}",
    "\u{301}",
    "\u{301}\u{302}",
    "中文",
    "日本語",
    "한국어",
    "Ελληνικά",
    "русский",
    "العربية",
    "עברית",
    "हिन्दी",
    "😀",
    "👩\u{200d}👩\u{200d}👧",
    "🇫🇷",
    "✋🏽",
    "❤\u{fe0f}",
    "\u{a7cf}",
    "\u{a7cf}\",",
    "\u{378}",
    "\u{e000}",
    "\u{10ffff}",
    "\u{1cc00}",
    "\u{1fae9}",
    "\u{31350}",
    "\u{e0041}",
    "\u{1d400}\u{1d401}",
    "ß",
    "ǅ",
    "\u{7f}",
    "\u{0}",
    "\\",
    "<|endoftext",
];

/// A small deterministic generator, so that failures can be replayed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }

    fn text(&mut self, max_pieces: usize) -> String {
        (0..self.below(max_pieces) + 1).map(|_| PIECES[self.below(PIECES.len())]).collect()
    }
}

/// The fixture tokenizer with its pre-tokenizer replaced by a `Split` pattern + `ByteLevel`.
fn with_split(dir: &Path, name: &str, pattern: &str) -> String {
    let mut tok: serde_json::Value = serde_json::from_slice(&std::fs::read(GPT2).unwrap()).unwrap();
    tok["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]});
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_vec(&tok).unwrap()).unwrap();
    path.to_str().unwrap().to_string()
}

/// `path`'s tokenizer with 256 more special tokens, as Llama-3's reserved ones.
fn with_reserved_tokens(dir: &Path, path: &str) -> String {
    let mut tok: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let first = tok["model"]["vocab"].as_object().unwrap().len();
    for n in 0..256 {
        tok["added_tokens"]
            .as_array_mut()
            .unwrap()
            .push(json!({"id": first + n, "content": format!("<|reserved_special_token_{n}|>"),
            "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}));
    }
    let out = dir.join("reserved.json");
    std::fs::write(&out, serde_json::to_vec(&tok).unwrap()).unwrap();
    out.to_str().unwrap().to_string()
}

fn splitter(path: &str) -> (Tokenizer, ByteLevelSplitter) {
    let tok = Tokenizer::from_file(path).unwrap();
    let splitter = ByteLevelSplitter::for_tokenizer(&tok).expect("a byte-level tokenizer without normalizer");
    (tok, splitter)
}

#[test]
fn pre_tokens_are_the_crates_on_random_texts() {
    let tmp = tempfile::tempdir().unwrap();
    let llama3 = with_split(tmp.path(), "llama3", LLAMA3_PATTERN);
    let qwen2 = with_split(tmp.path(), "qwen2", QWEN2_PATTERN);
    for (path, expected_path) in [(GPT2, "scanner (gpt2)"), (&llama3, "scanner (llama3)"), (&qwen2, "regex")] {
        let (tok, splitter) = splitter(path);
        assert_eq!(splitter.path(), expected_path, "{path}");
        let mut rng = Rng(7);
        for _ in 0..20_000 {
            let text = rng.text(24);
            let crate_cut = crate_words(tok.get_pre_tokenizer().unwrap(), &text).unwrap();
            assert_eq!(splitter.words(&text), crate_cut, "{expected_path} on {text:?}");
        }
    }
}

/// A JSONL corpus and a line-split text file (with a line of invalid UTF-8) of texts the fast
/// path must get right, including documents above the 1 MiB piece size.
fn write_corpus(dir: &Path) -> (String, String) {
    let mut docs: Vec<String> = Vec::new();
    // every code point but the surrogates, in runs of 4,096, each after and before other classes
    let all: Vec<char> = (0..=0x10FFFFu32).filter_map(char::from_u32).collect();
    for (i, chunk) in all.chunks(4096).enumerate() {
        let mut doc = String::new();
        for (j, &c) in chunk.iter().enumerate() {
            doc.push_str(["a", " ", "1", "\n", "'", ".", "  ", ""][(i + j) % 8]);
            doc.push(c);
        }
        docs.push(doc);
    }
    let mut rng = Rng(11);
    for _ in 0..300 {
        docs.push(rng.text(200));
    }
    // special tokens inside and around words
    docs.extend(
        ["a<|endoftext|>b", "<|endoftext|>", " <|endoftext|> <|endoftext|>x", "don't<|endoftext|>'s"].map(String::from),
    );
    docs.extend(
        ["x<|reserved_special_token_7|>y", " <|reserved_special_token_255|>\n", "<|reserved_special_token_256|>"]
            .map(String::from),
    );
    // large documents: cut into pieces, without cuts, and with a special token (never cut)
    let mut big = String::new();
    while big.len() < (5 << 20) / 2 {
        big.push_str(&rng.text(40));
        big.push_str(["\nfn main() {}\n", "\nHello\n", "\n\n  x\n", "\r\nSo "][rng.below(4)]);
    }
    docs.push(big.clone());
    docs.push(big.replace('\n', " "));
    let middle = big.len() / 2 + big.as_bytes()[big.len() / 2..].iter().position(|&b| b == b'\n').unwrap();
    docs.push(format!("{}<|endoftext|>{}", &big[..middle], &big[middle..]));
    let jsonl = dir.join("docs.jsonl");
    let lines: Vec<String> = docs.iter().map(|d| json!({ "text": d }).to_string()).collect();
    std::fs::write(&jsonl, lines.join("\n") + "\n").unwrap();
    let txt = dir.join("lines.txt");
    let mut raw = b"first line \xe2\x82\xac\n".to_vec();
    raw.extend_from_slice(b"broken \xff\xfe line\n");
    raw.extend_from_slice("last 'LL line ſ\n".as_bytes());
    std::fs::write(&txt, raw).unwrap();
    (jsonl.to_str().unwrap().to_string(), txt.to_str().unwrap().to_string())
}

#[test]
fn datasets_match_python_tokenizers_and_do_not_depend_on_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let (jsonl, txt) = write_corpus(tmp.path());
    let llama3 = with_split(tmp.path(), "llama3", LLAMA3_PATTERN);
    let reserved = with_reserved_tokens(tmp.path(), &llama3);
    for (name, scheme, tok) in
        [("gpt2", "gpt2", GPT2), ("llama3", "llama3", llama3.as_str()), ("reserved", "llama3", reserved.as_str())]
    {
        let mut outputs = Vec::new();
        // the thread counts matter for the scanners; the reserved tokens for the path taken
        let threads: &[&str] = if name == "reserved" { &["2"] } else { &["1", "2", "4"] };
        for threads in threads {
            let out = tmp.path().join(format!("{name}-{threads}"));
            let summary = run(&[
                jsonl.as_str(),
                txt.as_str(),
                "--tokenizer",
                tok,
                "--out",
                out.to_str().unwrap(),
                "--splits",
                "100,0,0",
                "--split-by",
                "line",
                "--threads",
                threads,
            ])
            .unwrap();
            assert_eq!(summary.path, format!("scanner ({scheme}) + word memo + byte-level merges"));
            assert_eq!(summary.stats.skipped.invalid_utf8, 1);
            outputs
                .push([std::fs::read(out.join("train.bin")).unwrap(), std::fs::read(out.join("train.idx")).unwrap()]);
        }
        assert!(outputs.iter().all(|o| *o == outputs[0]), "{name}: outputs differ between 1, 2 and 4 threads");
        let report = check_dataset(
            &tmp.path().join(format!("{name}-2")),
            json!({
                "tokenizer": tok, "add_special_tokens": true, "dtype": "uint16",
                "sources": [{"path": jsonl, "format": "jsonl", "text_key": "text"}, {"path": txt, "format": "line"}],
            }),
        );
        assert!(report["documents"].as_u64().unwrap() > 300, "{report}");
    }
}
