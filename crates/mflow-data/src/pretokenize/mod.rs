//! mflow's own pre-tokenizer for byte-level BPE tokenizers without a normalizer (GPT-2 style
//! `ByteLevel` with its regex, or a `Split` regex then `ByteLevel` without one, as Llama-3 has).
//!
//! The crate's pre-tokenizer builds a `NormalizedString` with per-byte alignments for every
//! word, which costs more than the BPE merges themselves. This one cuts the text into plain
//! byte ranges: with a hand-written [`Scanner`] for the GPT-2 and Llama-3 patterns (character
//! classes read off the crate's own regex engine, see [`classes`]), else with the pattern run by
//! that engine. The byte-to-character table comes from the crate's own pre-tokenizer. At load
//! both are checked against the crate's pre-tokenizer on a probe text, and not used if they
//! differ.

mod ascii;
mod classes;
mod scan;
mod unicode;

use aho_corasick::AhoCorasick;
use serde_json::Value;
use tokenizers::utils::SysRegex;
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, Tokenizer};

use scan::{Scanner, GPT2};

/// Text the splitter must cut and map exactly as the crate's pre-tokenizer does.
const PROBE_TEXT: &str =
    "Hello world's  \n\t  x123 4567 ½ 中文字 can't 'LL 'RE  \u{a0}e\u{301}\u{200b} 🚀!!\r\n   end...  \u{a7cf}\",  ";

/// How the words of a text are found.
enum Cutter {
    Scanner(Scanner),
    Regex(SysRegex),
}

/// Cuts text without added tokens into the words the tokenizer's model encodes one by one.
pub struct ByteLevelSplitter {
    cutter: Cutter,
    byte_chars: [char; 256],
    /// Finds the added tokens' contents; None when the tokenizer has none.
    added: Option<AhoCorasick>,
}

impl ByteLevelSplitter {
    /// None when the tokenizer is not of a supported shape or the probe check fails.
    pub fn for_tokenizer(tokenizer: &Tokenizer) -> Option<ByteLevelSplitter> {
        if tokenizer.get_normalizer().is_some() {
            return None;
        }
        let pre_tokenizer = tokenizer.get_pre_tokenizer()?;
        let pattern = supported_pattern(&serde_json::to_value(pre_tokenizer).ok()?)?;
        let cutter = match scan::Scheme::for_pattern(&pattern) {
            Some(scheme) => Cutter::Scanner(Scanner::new(scheme)),
            None => Cutter::Regex(SysRegex::new(&pattern).ok()?),
        };
        let added: Vec<String> = tokenizer.get_added_tokens_decoder().into_values().map(|t| t.content).collect();
        let added = if added.is_empty() { None } else { Some(AhoCorasick::new(&added).ok()?) };
        let splitter = ByteLevelSplitter { cutter, byte_chars: byte_chars(pre_tokenizer)?, added };
        splitter.matches_crate(pre_tokenizer).then_some(splitter)
    }

    /// Which pre-tokenizer runs: `scanner (gpt2)`, `scanner (llama3)`, or `regex` (the
    /// pattern in the crate's regex engine).
    pub fn path(&self) -> String {
        match &self.cutter {
            Cutter::Scanner(s) => format!("scanner ({})", s.scheme().name()),
            Cutter::Regex(_) => "regex".into(),
        }
    }

    /// Whether `text` may contain an added token (then the crate's added-token split runs first).
    pub(crate) fn may_hold_added_tokens(&self, text: &str) -> bool {
        self.added.as_ref().is_some_and(|added| added.is_match(text))
    }

    /// Calls `word(start, end)` on each pre-token of `text[from..to]` (a text without added
    /// tokens), in order: the pattern's matches and the gaps between them, as the crate splits.
    /// `from` and `to` are 0 and the length, or cuts from [`ByteLevelSplitter::cuts`]; the
    /// patterns look ahead past `to`, so the whole text is passed.
    #[inline]
    pub(crate) fn for_each_word<E>(
        &self,
        text: &str,
        from: usize,
        to: usize,
        mut word: impl FnMut(usize, usize) -> Result<(), E>,
    ) -> Result<(), E> {
        match &self.cutter {
            Cutter::Scanner(scanner) => scanner.for_each(text, from, to, word),
            Cutter::Regex(regex) => {
                debug_assert!(from == 0 && to == text.len(), "the regex path does not cut texts");
                let mut prev = 0;
                for (start, end) in regex.find_iter(text) {
                    if prev < start {
                        word(prev, start)?;
                    }
                    if start < end {
                        word(start, end)?;
                    }
                    prev = end;
                }
                if prev < text.len() {
                    word(prev, text.len())?;
                }
                Ok(())
            }
        }
    }

    /// Positions, about `every` bytes apart, where `text` can be cut and each piece
    /// pre-tokenized on its own (see [`Scanner::cuts`]). Empty when the regex path runs: its
    /// pattern is not known.
    pub(crate) fn cuts(&self, text: &str, every: usize) -> Vec<usize> {
        match &self.cutter {
            Cutter::Scanner(scanner) => scanner.cuts(text, every),
            Cutter::Regex(_) => Vec::new(),
        }
    }

    /// The byte-level alphabet: the character of each byte ('\0' for bytes never in UTF-8).
    pub(crate) fn byte_chars(&self) -> &[char; 256] {
        &self.byte_chars
    }

    /// `word` in the byte-level alphabet (one character per UTF-8 byte), as the model sees it.
    pub(crate) fn map_into(&self, word: &[u8], mapped: &mut String) {
        mapped.clear();
        mapped.extend(word.iter().map(|&b| self.byte_chars[b as usize]));
    }

    /// The words of `text` (without added tokens) in the byte-level alphabet.
    pub fn words(&self, text: &str) -> Vec<String> {
        let mut got = Vec::new();
        let _ = self.for_each_word(text, 0, text.len(), |s, e| -> Result<(), ()> {
            let mut mapped = String::new();
            self.map_into(&text.as_bytes()[s..e], &mut mapped);
            got.push(mapped);
            Ok(())
        });
        got
    }

    fn matches_crate(&self, pre_tokenizer: &tokenizers::PreTokenizerWrapper) -> bool {
        crate_words(pre_tokenizer, PROBE_TEXT).is_some_and(|expected| self.words(PROBE_TEXT) == expected)
    }
}

/// The split regex of a supported pre-tokenizer configuration.
fn supported_pattern(pre: &Value) -> Option<String> {
    let byte_level = |v: &Value, use_regex: bool| {
        v["type"] == "ByteLevel" && v["add_prefix_space"] == false && v.get("use_regex").is_none_or(|r| r == use_regex)
    };
    if byte_level(pre, true) {
        return Some(GPT2.to_string());
    }
    let steps = pre.get("pretokenizers")?.as_array()?;
    match steps.as_slice() {
        [split, bl] if pre["type"] == "Sequence" && byte_level(bl, false) => {
            let isolated = split["type"] == "Split" && split["behavior"] == "Isolated" && split["invert"] == false;
            isolated.then(|| split["pattern"]["Regex"].as_str().map(str::to_string)).flatten()
        }
        _ => None,
    }
}

/// Byte -> character table of the crate's byte-level pre-tokenizer, read off its output on
/// characters that together hold every byte valid UTF-8 can contain.
fn byte_chars(pre_tokenizer: &tokenizers::PreTokenizerWrapper) -> Option<[char; 256]> {
    let mut covered = [false; 256];
    let mut probe = String::new();
    for c in (0..=0x10FFFFu32).filter_map(char::from_u32) {
        let mut buf = [0u8; 4];
        let bytes = c.encode_utf8(&mut buf).as_bytes();
        if bytes.iter().any(|&b| !covered[b as usize]) {
            bytes.iter().for_each(|&b| covered[b as usize] = true);
            probe.push(c);
        }
    }
    let mapped: String = crate_words(pre_tokenizer, &probe)?.concat();
    if mapped.chars().count() != probe.len() {
        return None;
    }
    // bytes that never occur in UTF-8 (0xC0, 0xC1, 0xF5..) keep a placeholder never looked up
    let mut table = ['\0'; 256];
    for (b, c) in probe.bytes().zip(mapped.chars()) {
        table[b as usize] = c;
    }
    Some(table)
}

/// The words the crate's pre-tokenizer cuts `text` into, in the byte-level alphabet.
pub fn crate_words(pre_tokenizer: &tokenizers::PreTokenizerWrapper, text: &str) -> Option<Vec<String>> {
    let mut pretokenized = PreTokenizedString::from(text);
    pre_tokenizer.pre_tokenize(&mut pretokenized).ok()?;
    let splits = pretokenized.get_splits(OffsetReferential::Original, OffsetType::None);
    Some(splits.into_iter().map(|(s, _, _)| s.to_string()).collect())
}
