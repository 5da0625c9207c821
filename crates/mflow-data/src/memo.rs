//! Word-level memo over a Hugging Face tokenizer: the tokenizer's own added-token extraction,
//! normalizer and pre-tokenizer cut a document into words, and each distinct word goes through
//! the model (the BPE merges) once per worker instead of once per occurrence. The ids are those
//! of `Tokenizer::encode` by construction: the same steps run on the same strings, only the
//! model's answer for a word is reused.
//!
//! For byte-level BPE tokenizers without a normalizer, the words come from
//! [`ByteLevelSplitter`] instead of the crate's pre-tokenizer (same regex, same byte mapping,
//! without the per-word alignment bookkeeping), and the memo is keyed by the raw word.
//!
//! Used only when that equivalence holds: no truncation or padding, a deterministic model (no
//! BPE dropout), and a post-processor whose special tokens do not depend on the text (checked
//! at load by post-processing two probe encodings).

use std::collections::HashMap;
use std::sync::Mutex;

use tokenizers::models::ModelWrapper;
use tokenizers::{Encoding, Model, OffsetReferential, OffsetType, PreTokenizer, Token, Tokenizer};

use crate::bytelevel::ByteLevelSplitter;

/// Words longer than this skip the memo (they are rare and would crowd it).
const MAX_WORD_BYTES: usize = 256;
/// Bookkeeping per memo entry besides its key and ids: map slot, key box, arena range.
const ENTRY_OVERHEAD_BYTES: usize = 48;

/// Ids a post-processor puts around every single-sequence encoding.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Framing {
    pub prefix: Vec<u32>,
    pub suffix: Vec<u32>,
}

/// One worker's memo: word -> range of its ids in `ids`. Emptied when it reaches its byte cap,
/// so memory stays bounded whatever the corpus.
struct WordIds {
    ranges: HashMap<Box<str>, (u32, u32)>,
    ids: Vec<u32>,
    bytes: usize,
}

impl WordIds {
    fn new() -> WordIds {
        WordIds { ranges: HashMap::new(), ids: Vec::new(), bytes: 0 }
    }
}

/// The memo path of an encoder: a frame learnt at load and one word memo per worker thread.
pub(crate) struct WordMemo {
    framing: Framing,
    lean: Option<ByteLevelSplitter>,
    workers: Vec<Mutex<WordIds>>,
    cap_bytes_per_worker: usize,
}

impl WordMemo {
    /// Returns None when the tokenizer's configuration does not allow a memo that gives the
    /// same ids as `encode` (see the module comment).
    pub(crate) fn for_tokenizer(tokenizer: &Tokenizer, add_special_tokens: bool, workers: usize, cap_bytes: usize) -> Option<WordMemo> {
        if tokenizer.get_truncation().is_some() || tokenizer.get_padding().is_some() || cap_bytes == 0 {
            return None;
        }
        if let ModelWrapper::BPE(bpe) = tokenizer.get_model() {
            if bpe.dropout.is_some_and(|p| p > 0.0) {
                return None;
            }
        }
        let framing = if add_special_tokens { probe_framing(tokenizer)? } else { Framing::default() };
        let workers = workers.max(1);
        Some(WordMemo {
            framing,
            lean: ByteLevelSplitter::for_tokenizer(tokenizer),
            workers: (0..workers).map(|_| Mutex::new(WordIds::new())).collect(),
            cap_bytes_per_worker: (cap_bytes / workers).max(1 << 20),
        })
    }

    /// Whether words come from the lean byte-level splitter rather than the crate's pre-tokenizer.
    pub(crate) fn is_lean(&self) -> bool {
        self.lean.is_some()
    }

    /// Appends the ids of `text` to `out`, as `tokenizer.encode(text, add_special_tokens)` gives them.
    pub(crate) fn encode_into(&self, tokenizer: &Tokenizer, text: &str, out: &mut Vec<u32>) -> tokenizers::Result<()> {
        let worker = rayon::current_thread_index().unwrap_or(0) % self.workers.len();
        let mut memo = self.workers[worker].lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let memo = &mut *memo;
        let cap = self.cap_bytes_per_worker;
        let model = tokenizer.get_model();
        out.extend_from_slice(&self.framing.prefix);
        match &self.lean {
            Some(lean) => {
                let mut mapped = String::new();
                let mut lean_words = |segment: &str, out: &mut Vec<u32>| {
                    lean.for_each_word(segment, |word| {
                        memo.ids_of(word, cap, out, || {
                            lean.map_into(word, &mut mapped);
                            model.tokenize(&mapped)
                        })
                    })
                };
                if lean.may_hold_added_tokens(text) {
                    let pretokenized = tokenizer.get_added_vocabulary().extract_and_normalize(tokenizer.get_normalizer(), text);
                    for (segment, _, tokens) in pretokenized.get_splits(OffsetReferential::Original, OffsetType::None) {
                        match tokens {
                            Some(tokens) => out.extend(tokens.iter().map(|t| t.id)),
                            None => lean_words(segment, out)?,
                        }
                    }
                } else {
                    lean_words(text, out)?;
                }
            }
            None => {
                let mut pretokenized = tokenizer.get_added_vocabulary().extract_and_normalize(tokenizer.get_normalizer(), text);
                if let Some(pre) = tokenizer.get_pre_tokenizer() {
                    pre.pre_tokenize(&mut pretokenized)?;
                }
                for (word, _, tokens) in pretokenized.get_splits(OffsetReferential::Original, OffsetType::None) {
                    match tokens {
                        // added tokens come out of the extraction already tokenized
                        Some(tokens) => out.extend(tokens.iter().map(|t| t.id)),
                        None => memo.ids_of(word, cap, out, || model.tokenize(word))?,
                    }
                }
            }
        }
        out.extend_from_slice(&self.framing.suffix);
        Ok(())
    }
}

impl WordIds {
    /// Appends the ids of `word`, from the memo or else from `tokenize` (then remembered).
    fn ids_of(
        &mut self,
        word: &str,
        cap_bytes: usize,
        out: &mut Vec<u32>,
        tokenize: impl FnOnce() -> tokenizers::Result<Vec<Token>>,
    ) -> tokenizers::Result<()> {
        if let Some(&(start, len)) = self.ranges.get(word) {
            out.extend_from_slice(&self.ids[start as usize..(start + len) as usize]);
            return Ok(());
        }
        let tokens = tokenize()?;
        out.extend(tokens.iter().map(|t| t.id));
        if word.len() > MAX_WORD_BYTES {
            return Ok(());
        }
        let cost = word.len() + 4 * tokens.len() + ENTRY_OVERHEAD_BYTES;
        if self.bytes + cost > cap_bytes {
            self.ranges.clear();
            self.ids.clear();
            self.bytes = 0;
        }
        let start = self.ids.len() as u32;
        self.ids.extend(tokens.iter().map(|t| t.id));
        self.ranges.insert(word.into(), (start, tokens.len() as u32));
        self.bytes += cost;
        Ok(())
    }
}

/// The ids the post-processor adds around a single sequence, learnt by post-processing probe
/// encodings of one and of two tokens. None when the two disagree or the content does not come
/// through in order: such a post-processor is not a fixed frame.
fn probe_framing(tokenizer: &Tokenizer) -> Option<Framing> {
    // ids beyond any vocabulary, so that they cannot be confused with added special tokens
    const PROBE: [u32; 2] = [u32::MAX - 1, u32::MAX - 2];
    let frame_of = |content: &[u32]| -> Option<Framing> {
        let tokens = content.iter().map(|&id| Token::new(id, "x".into(), (0, 1))).collect();
        let done = tokenizer.post_process(Encoding::from_tokens(tokens, 0), None, true).ok()?;
        let ids = done.get_ids();
        let at = ids.windows(content.len()).position(|w| w == content)?;
        let (prefix, rest) = ids.split_at(at);
        let suffix = &rest[content.len()..];
        if prefix.iter().chain(suffix).any(|id| PROBE.contains(id)) {
            return None;
        }
        Some(Framing { prefix: prefix.to_vec(), suffix: suffix.to_vec() })
    };
    let one = frame_of(&PROBE[..1])?;
    (frame_of(&PROBE)? == one).then_some(one)
}
