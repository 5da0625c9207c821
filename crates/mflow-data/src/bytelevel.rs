//! A lean pre-tokenizer for byte-level BPE tokenizers without a normalizer (GPT-2 style
//! `ByteLevel` with its regex, or Llama-3 style `Split` regex then `ByteLevel` without one).
//!
//! The crate's pre-tokenizer builds a `NormalizedString` with per-byte alignments for every
//! word, which costs more than the BPE merges themselves. This one runs the same regex with the
//! same engine over the text and yields plain `&str` words; the byte-to-character table comes
//! from the crate's own pre-tokenizer. At load it is checked against the crate's pre-tokenizer on
//! a probe text, and not used when they differ.

use serde_json::Value;
use tokenizers::utils::SysRegex;
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, Tokenizer};

/// The regex of the crate's `ByteLevel` pre-tokenizer when `use_regex` is set (GPT-2's).
const GPT2_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Beyond this many added tokens, documents always go through the crate's added-token split.
const MAX_ADDED_TOKENS_SCANNED: usize = 64;
/// Text the splitter must cut and map exactly as the crate's pre-tokenizer does.
const PROBE_TEXT: &str = "Hello world's  \n\t  x123 4567 ½ 中文字 can't 'LL 'RE  \u{a0}e\u{301}\u{200b} 🚀!!\r\n   end...  ";

pub(crate) struct ByteLevelSplitter {
    regex: SysRegex,
    byte_chars: [char; 256],
    /// Contents of the added tokens, or None when there are too many to scan for.
    added: Option<Vec<String>>,
}

impl ByteLevelSplitter {
    /// None when the tokenizer is not of a supported shape or the probe check fails.
    pub(crate) fn for_tokenizer(tokenizer: &Tokenizer) -> Option<ByteLevelSplitter> {
        if tokenizer.get_normalizer().is_some() {
            return None;
        }
        let pre_tokenizer = tokenizer.get_pre_tokenizer()?;
        let pattern = supported_pattern(&serde_json::to_value(pre_tokenizer).ok()?)?;
        let added: Vec<String> = tokenizer.get_added_tokens_decoder().into_values().map(|t| t.content).collect();
        let splitter = ByteLevelSplitter {
            regex: SysRegex::new(&pattern).ok()?,
            byte_chars: byte_chars(pre_tokenizer)?,
            added: (added.len() <= MAX_ADDED_TOKENS_SCANNED).then_some(added),
        };
        splitter.matches_crate(pre_tokenizer).then_some(splitter)
    }

    /// Whether `text` may contain an added token (then the crate's added-token split runs first).
    pub(crate) fn may_hold_added_tokens(&self, text: &str) -> bool {
        self.added.as_ref().is_none_or(|added| added.iter().any(|a| text.contains(a.as_str())))
    }

    /// Calls `word` on each pre-token of `segment` (a text without added tokens), in order:
    /// regex matches and the gaps between them, empty ones left out, as the crate splits.
    pub(crate) fn for_each_word<'t, E>(&self, segment: &'t str, mut word: impl FnMut(&'t str) -> Result<(), E>) -> Result<(), E> {
        let mut prev = 0;
        for (start, end) in self.regex.find_iter(segment) {
            if prev < start {
                word(&segment[prev..start])?;
            }
            if start < end {
                word(&segment[start..end])?;
            }
            prev = end;
        }
        if prev < segment.len() {
            word(&segment[prev..])?;
        }
        Ok(())
    }

    /// `word` in the byte-level alphabet (one character per UTF-8 byte), as the model sees it.
    pub(crate) fn map_into(&self, word: &str, mapped: &mut String) {
        mapped.clear();
        mapped.extend(word.bytes().map(|b| self.byte_chars[b as usize]));
    }

    fn matches_crate(&self, pre_tokenizer: &tokenizers::PreTokenizerWrapper) -> bool {
        let Some(expected) = crate_words(pre_tokenizer, PROBE_TEXT) else { return false };
        let mut got = Vec::new();
        let mut mapped = String::new();
        let _ = self.for_each_word(PROBE_TEXT, |w| -> Result<(), ()> {
            self.map_into(w, &mut mapped);
            got.push(mapped.clone());
            Ok(())
        });
        got == expected
    }
}

/// The split regex of a supported pre-tokenizer configuration.
fn supported_pattern(pre: &Value) -> Option<String> {
    let byte_level = |v: &Value, use_regex: bool| {
        v["type"] == "ByteLevel" && v["add_prefix_space"] == false && v.get("use_regex").is_none_or(|r| r == use_regex)
    };
    if byte_level(pre, true) {
        return Some(GPT2_PATTERN.to_string());
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
fn crate_words(pre_tokenizer: &tokenizers::PreTokenizerWrapper, text: &str) -> Option<Vec<String>> {
    let mut pretokenized = PreTokenizedString::from(text);
    pre_tokenizer.pre_tokenize(&mut pretokenized).ok()?;
    let splits = pretokenized.get_splits(OffsetReferential::Original, OffsetType::None);
    Some(splits.into_iter().map(|(s, _, _)| s.to_string()).collect())
}
