//! The merges of a byte-level BPE model, for the words the memo has not seen: the crate's own
//! algorithm (`Word::merge_all`: a queue of pairs ordered by rank then position, an entry taken
//! only while its pair still makes the same token) over the ids of a word's bytes, without the
//! crate's per-word allocations (a `Token` with its string for every id, a cache behind a lock).
//!
//! Used only for the configurations where the crate does nothing more than that: no dropout, no
//! subword prefix or suffix, and every byte's character in the vocabulary (so no unknown token
//! and no byte fallback). `ignore_merges` (a word that is a token is that token) is honoured.
//! At load the merges are checked against the crate's model on a sample of the vocabulary.

use std::borrow::Cow;

use hashbrown::HashMap;
use serde::Deserialize;
use tokenizers::models::ModelWrapper;
use tokenizers::{Model, Tokenizer};

/// Words with more symbols than this go to the crate's model (its queue is then the faster).
const MAX_SYMBOLS: usize = 64;

pub(crate) struct ByteLevelBpe {
    /// The id of each byte's character; u32::MAX for bytes that are never in UTF-8.
    byte_ids: [u32; 256],
    /// (left, right) -> (rank, merged id), as the crate keeps them (a pair given twice: the later).
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// Raw bytes of every token, for `ignore_merges`; None when the model merges every word.
    whole_words: Option<HashMap<Box<[u8]>, u32>>,
}

impl ByteLevelBpe {
    /// None unless the tokenizer's model is a BPE this module encodes exactly like the crate
    /// (see the module comment). `byte_chars` is the byte-level alphabet of its pre-tokenizer.
    pub(crate) fn for_tokenizer(tokenizer: &Tokenizer, byte_chars: &[char; 256]) -> Option<ByteLevelBpe> {
        let ModelWrapper::BPE(model) = tokenizer.get_model() else { return None };
        if model.dropout.is_some() || model.continuing_subword_prefix.is_some() || model.end_of_word_suffix.is_some() {
            return None;
        }
        let id = |token: &str| model.token_to_id(token);
        let mut byte_ids = [u32::MAX; 256];
        for (b, c) in byte_chars.iter().enumerate() {
            if *c != '\0' {
                byte_ids[b] = id(c.encode_utf8(&mut [0; 4]))?;
            }
        }
        // The model keeps its merges in a private map; it lists them in rank order when it
        // serializes itself.
        let text = serde_json::to_vec(model).ok()?;
        let listed: Listed = serde_json::from_slice(&text).ok()?;
        let mut merges = HashMap::with_capacity(listed.merges.len());
        let mut joined = String::new();
        for (rank, merge) in listed.merges.iter().enumerate() {
            let (left, right) = merge.halves()?;
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            merges.insert((id(left)?, id(right)?), (u32::try_from(rank).ok()?, id(&joined)?));
        }
        let whole_words = model.ignore_merges.then(|| {
            let unmap: HashMap<char, u8> = byte_chars.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
            model
                .get_vocab()
                .into_iter()
                .filter_map(|(token, id)| {
                    let raw: Option<Vec<u8>> = token.chars().map(|c| unmap.get(&c).copied()).collect();
                    Some((raw?.into_boxed_slice(), id))
                })
                .collect()
        });
        let bpe = ByteLevelBpe { byte_ids, merges, whole_words };
        bpe.matches_model(model, byte_chars).then_some(bpe)
    }

    /// Appends the ids of the raw bytes `word` to `out`; false (nothing appended) when the word
    /// is for the crate's model (too many symbols, or a byte outside UTF-8).
    #[inline]
    pub(crate) fn encode(&self, word: &[u8], out: &mut Vec<u32>) -> bool {
        if word.len() > MAX_SYMBOLS {
            return false;
        }
        if let Some(id) = self.whole_words.as_ref().and_then(|w| w.get(word)) {
            out.push(*id);
            return true;
        }
        let mut ids = [0u32; MAX_SYMBOLS];
        for (slot, &b) in ids.iter_mut().zip(word) {
            *slot = self.byte_ids[b as usize];
            if *slot == u32::MAX {
                return false;
            }
        }
        let n = self.merge_all(&mut ids[..word.len()]);
        out.extend_from_slice(&ids[..n]);
        true
    }

    /// `Word::merge_all` of the crate without dropout, on a word of at most MAX_SYMBOLS
    /// symbols kept as a list in `ids` (removed symbols are skipped through `next`); returns
    /// the number of symbols left, compacted to the front of `ids`.
    fn merge_all(&self, ids: &mut [u32]) -> usize {
        let n = ids.len();
        if n < 2 {
            return n;
        }
        // symbol i: ids[i], alive[i], prev/next by index (MAX_SYMBOLS fits in u8; u8::MAX: none)
        let mut next = [0u8; MAX_SYMBOLS];
        let mut prev = [0u8; MAX_SYMBOLS];
        let mut alive = [true; MAX_SYMBOLS];
        for i in 0..n {
            next[i] = (i + 1) as u8;
            prev[i] = i.wrapping_sub(1) as u8;
        }
        // the queue, taken smallest rank first, then position
        let mut queue: Vec<Entry> = Vec::with_capacity(2 * n);
        for i in 0..n - 1 {
            if let Some(&(rank, merged)) = self.merges.get(&(ids[i], ids[i + 1])) {
                queue.push(Entry { rank, pos: i as u8, pair: (ids[i], ids[i + 1]), merged });
            }
        }
        while let Some(best) = take_min(&mut queue) {
            let (pos, merged) = (best.pos as usize, best.merged);
            let right = next[pos] as usize;
            if !alive[pos] || right >= n {
                continue;
            }
            // An entry made before a neighbour changed is still good only if the pair there now
            // makes the same token (the crate's test); an unchanged pair does.
            let pair = (ids[pos], ids[right]);
            if pair != best.pair && self.merges.get(&pair).is_none_or(|&(_, id)| id != merged) {
                continue;
            }
            ids[pos] = merged;
            alive[right] = false;
            next[pos] = next[right];
            if (next[pos] as usize) < n {
                prev[next[pos] as usize] = pos as u8;
            }
            for (at, pair) in [(prev[pos] as usize, pos), (pos, next[pos] as usize)] {
                if at < n && pair < n {
                    let pair = (ids[at], ids[pair]);
                    if let Some(&(rank, merged)) = self.merges.get(&pair) {
                        queue.push(Entry { rank, pos: at as u8, pair, merged });
                    }
                }
            }
        }
        let mut kept = 0;
        for i in 0..n {
            if alive[i] {
                ids[kept] = ids[i];
                kept += 1;
            }
        }
        kept
    }

    /// About CHECKED tokens of the vocabulary (every n-th id), as raw bytes, encoded here and by
    /// the crate's model. The tests compare the two on whole vocabularies and random merge tables.
    fn matches_model(&self, model: &tokenizers::models::bpe::BPE, byte_chars: &[char; 256]) -> bool {
        const CHECKED: usize = 2048;
        let unmap: HashMap<char, u8> = byte_chars.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        let size = model.get_vocab_size();
        let mut ours = Vec::new();
        for id in (0..size as u32).step_by((size / CHECKED).max(1)) {
            let Some(token) = model.id_to_token(id) else { continue };
            let Some(raw) = token.chars().map(|c| unmap.get(&c).copied()).collect::<Option<Vec<u8>>>() else {
                continue; // an added or special token outside the byte alphabet
            };
            ours.clear();
            if !self.encode(&raw, &mut ours) {
                continue;
            }
            let Ok(theirs) = model.tokenize(&token) else { return false };
            if !theirs.iter().map(|t| t.id).eq(ours.iter().copied()) {
                return false;
            }
        }
        true
    }
}

/// The merges of a serialized BPE model, in rank order.
#[derive(Deserialize)]
struct Listed<'a> {
    #[serde(borrow)]
    merges: Vec<Merge<'a>>,
}

/// A merge as `["left", "right"]`, or as the older `"left right"`.
#[derive(Deserialize)]
#[serde(untagged)]
enum Merge<'a> {
    Pair(#[serde(borrow)] Cow<'a, str>, #[serde(borrow)] Cow<'a, str>),
    Joined(#[serde(borrow)] Cow<'a, str>),
}

impl Merge<'_> {
    fn halves(&self) -> Option<(&str, &str)> {
        match self {
            Merge::Pair(left, right) => Some((left, right)),
            Merge::Joined(joined) => joined.split_once(' '),
        }
    }
}

/// A pair of neighbours that a merge makes one token, as the crate queues it.
#[derive(Clone, Copy)]
struct Entry {
    rank: u32,
    pos: u8,
    /// The ids the pair had when it was queued.
    pair: (u32, u32),
    merged: u32,
}

/// Removes and returns the entry of smallest (rank, position): the order of the crate's queue.
/// A linear scan: the queue of a word of at most MAX_SYMBOLS symbols is short.
#[inline]
fn take_min(queue: &mut Vec<Entry>) -> Option<Entry> {
    let mut best = 0;
    for (i, e) in queue.iter().enumerate().skip(1) {
        if (e.rank, e.pos) < (queue[best].rank, queue[best].pos) {
            best = i;
        }
    }
    (!queue.is_empty()).then(|| queue.swap_remove(best))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pretokenize::ByteLevelSplitter;
    use serde_json::json;

    /// A small deterministic generator (xorshift), so that failures repeat.
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n as u64) as usize
        }
    }

    fn fixture() -> serde_json::Value {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tokenizer/tokenizer.json");
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
    }

    fn load(json: &serde_json::Value) -> (Tokenizer, Option<ByteLevelBpe>) {
        let tokenizer = Tokenizer::from_bytes(serde_json::to_vec(json).unwrap()).unwrap();
        let lean = ByteLevelSplitter::for_tokenizer(&tokenizer).expect("a byte-level tokenizer");
        let bpe = ByteLevelBpe::for_tokenizer(&tokenizer, lean.byte_chars());
        (tokenizer, bpe)
    }

    /// `bpe` and the crate's model give the same ids for every word.
    fn assert_same<'a>(tokenizer: &Tokenizer, bpe: &ByteLevelBpe, words: impl IntoIterator<Item = &'a [u8]>) -> usize {
        let lean = ByteLevelSplitter::for_tokenizer(tokenizer).unwrap();
        let (mut mapped, mut ours, mut checked) = (String::new(), Vec::new(), 0);
        for word in words {
            ours.clear();
            if !bpe.encode(word, &mut ours) {
                continue;
            }
            lean.map_into(word, &mut mapped);
            let theirs: Vec<u32> = tokenizer.get_model().tokenize(&mapped).unwrap().iter().map(|t| t.id).collect();
            assert_eq!(ours, theirs, "word {:?}", String::from_utf8_lossy(word));
            checked += 1;
        }
        checked
    }

    /// The words of the tests' tricky corpus and of random texts over few letters, every length.
    fn words(tokenizer: &Tokenizer) -> Vec<Vec<u8>> {
        let lean = ByteLevelSplitter::for_tokenizer(tokenizer).unwrap();
        let corpus =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/memo/tricky.jsonl")).unwrap();
        let mut out = Vec::new();
        for line in corpus.lines() {
            let text = serde_json::from_str::<serde_json::Value>(line).unwrap()["text"].as_str().unwrap().to_string();
            let _ = lean.for_each_word(&text, 0, text.len(), |s, e| -> Result<(), ()> {
                out.push(text.as_bytes()[s..e].to_vec());
                Ok(())
            });
        }
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let letters = b" etaoinsrhl\n";
        for len in 1..=MAX_SYMBOLS {
            for _ in 0..200 {
                out.push((0..len).map(|_| letters[rng.below(letters.len())]).collect());
            }
        }
        out
    }

    #[test]
    fn gpt2_style_merges_are_the_crates() {
        let (tokenizer, bpe) = load(&fixture());
        let bpe = bpe.expect("the fixture's merges are taken");
        assert!(assert_same(&tokenizer, &bpe, words(&tokenizer).iter().map(Vec::as_slice)) > 10_000);
    }

    #[test]
    fn ignore_merges_and_the_old_merges_format_are_the_crates() {
        let mut json = fixture();
        json["model"]["ignore_merges"] = json!(true);
        let merges: Vec<serde_json::Value> = json["model"]["merges"]
            .as_array()
            .unwrap()
            .iter()
            .map(|pair| json!(format!("{} {}", pair[0].as_str().unwrap(), pair[1].as_str().unwrap())))
            .collect();
        json["model"]["merges"] = json!(merges);
        let (tokenizer, bpe) = load(&json);
        let bpe = bpe.expect("ignore_merges and 'a b' merges are taken");
        assert!(bpe.whole_words.is_some());
        assert!(assert_same(&tokenizer, &bpe, words(&tokenizer).iter().map(Vec::as_slice)) > 10_000);
    }

    /// Merges that make one token from two different pairs ("ab"+"c" and "a"+"bc"), ranked in
    /// random orders: the queue entries that go stale are judged as the crate judges them.
    #[test]
    fn tokens_made_by_several_merges_are_the_crates() {
        let alphabet: Vec<String> = {
            let (tokenizer, _) = load(&fixture());
            let lean = ByteLevelSplitter::for_tokenizer(&tokenizer).unwrap();
            lean.byte_chars().iter().filter(|&&c| c != '\0').map(char::to_string).collect()
        };
        let mut rng = Rng(7);
        for round in 0..20 {
            let mut vocab: Vec<String> = alphabet.clone();
            let mut merges: Vec<(String, String)> = Vec::new();
            // tokens over a, b, c only, built from any two earlier ones
            let mut made: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
            for _ in 0..60 {
                let (l, r) = (made[rng.below(made.len())].clone(), made[rng.below(made.len())].clone());
                if l.len() + r.len() > 8 || merges.contains(&(l.clone(), r.clone())) {
                    continue;
                }
                let joined = format!("{l}{r}");
                if !vocab.contains(&joined) {
                    vocab.push(joined.clone());
                    made.push(joined);
                }
                merges.push((l, r));
            }
            let mut json = fixture();
            json["added_tokens"] = json!([]);
            json["post_processor"] = serde_json::Value::Null;
            json["model"]["vocab"] = vocab.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
            json["model"]["merges"] = json!(merges.iter().map(|(l, r)| json!([l, r])).collect::<Vec<_>>());
            let (tokenizer, bpe) = load(&json);
            let bpe = bpe.unwrap_or_else(|| panic!("round {round}: the merges are not taken"));
            let words: Vec<Vec<u8>> =
                (0..3000).map(|_| (0..1 + rng.below(MAX_SYMBOLS)).map(|_| b"abc"[rng.below(3)]).collect()).collect();
            assert_eq!(assert_same(&tokenizer, &bpe, words.iter().map(Vec::as_slice)), words.len());
        }
    }

    #[test]
    fn models_that_do_more_than_merge_are_left_to_the_crate() {
        for (key, value) in
            [("dropout", json!(0.1)), ("continuing_subword_prefix", json!("##")), ("end_of_word_suffix", json!("</w>"))]
        {
            let mut json = fixture();
            json["model"][key] = value;
            // merges of tokens with a prefix or suffix would name other tokens; none are needed
            json["model"]["merges"] = json!([]);
            if key == "dropout" {
                // a dropout model still loads; only the merges must be refused
                let tokenizer = Tokenizer::from_bytes(serde_json::to_vec(&json).unwrap()).unwrap();
                let chars = ByteLevelSplitter::for_tokenizer(&tokenizer).map(|l| *l.byte_chars());
                assert!(chars.is_none_or(|c| ByteLevelBpe::for_tokenizer(&tokenizer, &c).is_none()), "{key}");
                continue;
            }
            let tokenizer = Tokenizer::from_bytes(serde_json::to_vec(&json).unwrap()).unwrap();
            if let Some(lean) = ByteLevelSplitter::for_tokenizer(&tokenizer) {
                assert!(ByteLevelBpe::for_tokenizer(&tokenizer, lean.byte_chars()).is_none(), "{key}");
            }
        }
        // a byte whose character is not in the vocabulary: the crate's unknown-token rules apply
        let mut json = fixture();
        json["model"]["vocab"].as_object_mut().unwrap().remove("Ā");
        json["model"]["merges"] = json!([]);
        let tokenizer = Tokenizer::from_bytes(serde_json::to_vec(&json).unwrap()).unwrap();
        let lean = ByteLevelSplitter::for_tokenizer(&tokenizer).unwrap();
        assert!(ByteLevelBpe::for_tokenizer(&tokenizer, lean.byte_chars()).is_none());
    }

    #[test]
    fn long_words_go_to_the_crate() {
        let (_, bpe) = load(&fixture());
        let bpe = bpe.unwrap();
        let mut out = Vec::new();
        assert!(!bpe.encode(&[b'a'; MAX_SYMBOLS + 1], &mut out) && out.is_empty());
        assert!(bpe.encode(&[b'a'; MAX_SYMBOLS], &mut out) && !out.is_empty());
    }
}
