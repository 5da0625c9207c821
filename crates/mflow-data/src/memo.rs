//! Word-level memo over a Hugging Face tokenizer: the tokenizer's own added-token extraction,
//! normalizer and pre-tokenizer cut a document into words, and each distinct word goes through
//! the model (the BPE merges) once per worker instead of once per occurrence. The ids are those
//! of `Tokenizer::encode` by construction: the same steps run on the same strings, only the
//! model's answer for a word is reused.
//!
//! For byte-level BPE tokenizers without a normalizer, the words come from mflow's
//! [`ByteLevelSplitter`] instead of the crate's pre-tokenizer (same cuts, same byte mapping,
//! without the per-word alignment bookkeeping), and the memo is keyed by the raw word.
//!
//! Used only when that equivalence holds: no truncation or padding, a deterministic model (no
//! BPE dropout), and a post-processor whose special tokens do not depend on the text (checked
//! at load by post-processing two probe encodings).

use std::sync::Mutex;

use tokenizers::models::ModelWrapper;
use tokenizers::{Encoding, Model, OffsetReferential, OffsetType, PreTokenizer, Token, Tokenizer};

use crate::bpe::ByteLevelBpe;
use crate::pretokenize::ByteLevelSplitter;
use crate::words::WordIds;

/// Documents are encoded in pieces of about this size, in parallel, so that one large
/// document does not keep one thread busy while the others wait.
const PIECE_BYTES: usize = 1 << 20;

/// Ids a post-processor puts around every single-sequence encoding.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Framing {
    pub prefix: Vec<u32>,
    pub suffix: Vec<u32>,
}

/// The memo path of an encoder: a frame learnt at load and one word memo per worker thread.
pub(crate) struct WordMemo {
    framing: Framing,
    lean: Option<ByteLevelSplitter>,
    /// The merges of new words, with mflow's pre-tokenizer, where they match the crate's model.
    merges: Option<ByteLevelBpe>,
    workers: Vec<Mutex<WordIds>>,
}

impl WordMemo {
    /// Returns None when the tokenizer's configuration does not allow a memo that gives the
    /// same ids as `encode` (see the module comment).
    pub(crate) fn for_tokenizer(
        tokenizer: &Tokenizer,
        add_special_tokens: bool,
        workers: usize,
        cap_bytes: usize,
    ) -> Option<WordMemo> {
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
        let cap_per_worker = (cap_bytes / workers).max(1 << 20);
        let lean = ByteLevelSplitter::for_tokenizer(tokenizer);
        let merges = lean.as_ref().and_then(|lean| ByteLevelBpe::for_tokenizer(tokenizer, lean.byte_chars()));
        Some(WordMemo {
            framing,
            lean,
            merges,
            workers: (0..workers).map(|_| Mutex::new(WordIds::new(cap_per_worker))).collect(),
        })
    }

    /// mflow's own pre-tokenizer, when it runs instead of the crate's.
    pub(crate) fn lean(&self) -> Option<&ByteLevelSplitter> {
        self.lean.as_ref()
    }

    /// Whether mflow's own merges encode new words (else the crate's model).
    pub(crate) fn own_merges(&self) -> bool {
        self.merges.is_some()
    }

    /// Appends the ids of `text` to `out`, as `tokenizer.encode(text, add_special_tokens)` gives
    /// them. A large document without added tokens is encoded in pieces, in parallel on the
    /// current rayon pool.
    pub(crate) fn encode_into(&self, tokenizer: &Tokenizer, text: &str, out: &mut Vec<u32>) -> tokenizers::Result<()> {
        out.extend_from_slice(&self.framing.prefix);
        match self.lean.as_ref().filter(|lean| !lean.may_hold_added_tokens(text)) {
            // mflow's pre-tokenizer over the whole text, or its pieces
            Some(lean) => {
                let cuts = if text.len() > PIECE_BYTES { lean.cuts(text, PIECE_BYTES) } else { Vec::new() };
                let starts = std::iter::once(0).chain(cuts.iter().copied());
                let pieces: Vec<(usize, usize)> = starts.zip(cuts.iter().copied().chain([text.len()])).collect();
                if let [whole] = pieces[..] {
                    self.encode_words(tokenizer, text, Some(whole), out)?;
                } else {
                    use rayon::prelude::*;
                    let ids: Vec<Vec<u32>> = pieces
                        .into_par_iter()
                        .map(|piece| {
                            let mut ids = Vec::new();
                            self.encode_words(tokenizer, text, Some(piece), &mut ids).map(|()| ids)
                        })
                        .collect::<tokenizers::Result<_>>()?;
                    ids.iter().for_each(|piece| out.extend_from_slice(piece));
                }
            }
            None => self.encode_words(tokenizer, text, None, out)?,
        }
        out.extend_from_slice(&self.framing.suffix);
        Ok(())
    }

    /// The ids of the words of `text` without the framing: of its `piece` when it holds no added
    /// token (mflow's pre-tokenizer), else of the whole text after the crate's added-token
    /// split. Holds this worker's memo, and calls nothing that waits on other workers.
    fn encode_words(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        piece: Option<(usize, usize)>,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        let worker = rayon::current_thread_index().unwrap_or(0) % self.workers.len();
        let mut memo = self.workers[worker].lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let memo = &mut *memo;
        let model = tokenizer.get_model();
        match &self.lean {
            Some(lean) => {
                let mut mapped = String::new();
                let mut lean_words = |segment: &str, from: usize, to: usize, out: &mut Vec<u32>| {
                    let bytes = segment.as_bytes();
                    lean.for_each_word(segment, from, to, |start, end| {
                        memo.ids_of(bytes, start, end, out, |word, out| {
                            if self.merges.as_ref().is_some_and(|merges| merges.encode(word, out)) {
                                return Ok(());
                            }
                            lean.map_into(word, &mut mapped);
                            out.extend(model.tokenize(&mapped)?.iter().map(|t| t.id));
                            Ok(())
                        })
                    })
                };
                if let Some((from, to)) = piece {
                    lean_words(text, from, to, out)?;
                } else {
                    let pretokenized =
                        tokenizer.get_added_vocabulary().extract_and_normalize(tokenizer.get_normalizer(), text);
                    for (segment, _, tokens) in pretokenized.get_splits(OffsetReferential::Original, OffsetType::None) {
                        match tokens {
                            Some(tokens) => out.extend(tokens.iter().map(|t| t.id)),
                            None => lean_words(segment, 0, segment.len(), out)?,
                        }
                    }
                }
            }
            None => {
                let mut pretokenized =
                    tokenizer.get_added_vocabulary().extract_and_normalize(tokenizer.get_normalizer(), text);
                if let Some(pre) = tokenizer.get_pre_tokenizer() {
                    pre.pre_tokenize(&mut pretokenized)?;
                }
                for (word, _, tokens) in pretokenized.get_splits(OffsetReferential::Original, OffsetType::None) {
                    match tokens {
                        // added tokens come out of the extraction already tokenized
                        Some(tokens) => out.extend(tokens.iter().map(|t| t.id)),
                        None => memo.ids_of(word.as_bytes(), 0, word.len(), out, |_, out| {
                            out.extend(model.tokenize(word)?.iter().map(|t| t.id));
                            Ok(())
                        })?,
                    }
                }
            }
        }
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
