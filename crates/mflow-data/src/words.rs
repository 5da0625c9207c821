//! One worker's memo of word -> ids, bounded in bytes and emptied when full.
//!
//! Nearly all words (99.7% of a code and prose corpus) are at most 16 bytes long: they are keyed
//! by those bytes as two integers, zero-padded, with their length, and their ids (up to three,
//! which covers nearly all words of a 32k vocabulary) are stored in the same 32-byte slot, in a
//! `hashbrown` table with a seeded hash (a corpus cannot be made to collide), behind a small
//! two-way cache of recent words. One-byte words, a third of all, are found by their byte
//! without hashing. Longer words, up to [`MAX_WORD_BYTES`], go to a second map keyed by their
//! bytes.

use std::hash::BuildHasher;

use hashbrown::{DefaultHashBuilder, HashMap, HashTable};

/// Words longer than this skip the memo (they are rare and would crowd it).
pub(crate) const MAX_WORD_BYTES: usize = 256;
const SHORT_BYTES: usize = 16;
/// Sets of the cache of recent short words in front of the table: two words to a 64-byte line,
/// the last used first, 256 KiB in all, which stays in a core's L2 cache while the table does
/// not. Two ways instead of one direct-mapped slot per line send 40% (code) to 70% (prose) fewer
/// lookups to the table (7% less CPU on code); a direct-mapped cache of 1 MiB halved them and was
/// no faster. Prefetching the sets of 32 words ahead was slower.
const FRONT_SETS: usize = 4096;
const INLINE_IDS: usize = 3;
/// Bytes a short word's slot costs, counting the table's spare capacity.
const SHORT_COST: usize = 48;
/// Bookkeeping of a long word besides its key and ids: map slot, key box, arena range.
const LONG_OVERHEAD: usize = 48;

/// A set of the front cache: its most recently used word first, on one cache line.
#[derive(Clone, Copy, Default)]
#[repr(align(64))]
struct Set([Short; 2]);

#[derive(Clone, Copy, Default)]
struct Short {
    key: [u64; 2],
    /// Length in bytes (low byte) and number of ids (next byte); 0 in an empty slot.
    len_ids: u32,
    /// The ids, or when there are more than INLINE_IDS, their start in `spilled`.
    ids: [u32; INLINE_IDS],
}

pub(crate) struct WordIds {
    /// Secret seeds of the hash, so that a corpus cannot be made to collide.
    seeds: [u64; 2],
    /// One-byte words (a third of all words), by their byte.
    bytes: [Short; 256],
    /// Recently used short words, by hash.
    front: Box<[Set]>,
    short: HashTable<Short>,
    spilled: Vec<u32>,
    long: HashMap<Box<[u8]>, (u32, u32)>,
    long_ids: Vec<u32>,
    used_bytes: usize,
    cap_bytes: usize,
}

impl WordIds {
    pub(crate) fn new(cap_bytes: usize) -> WordIds {
        let random = DefaultHashBuilder::default();
        WordIds {
            seeds: [random.hash_one(0u8), random.hash_one(1u8)],
            bytes: [Short::default(); 256],
            front: vec![Set::default(); FRONT_SETS].into_boxed_slice(),
            short: HashTable::new(),
            spilled: Vec::new(),
            long: HashMap::new(),
            long_ids: Vec::new(),
            used_bytes: 0,
            cap_bytes,
        }
    }

    /// Appends the ids of the word `text[start..end]`, from the memo or else from `tokenize`
    /// (then remembered). `text` is the word's surroundings: bytes after it speed up the key.
    #[inline]
    pub(crate) fn ids_of(
        &mut self,
        text: &[u8],
        start: usize,
        end: usize,
        out: &mut Vec<u32>,
        tokenize: impl FnOnce(&[u8], &mut Vec<u32>) -> tokenizers::Result<()>,
    ) -> tokenizers::Result<()> {
        let len = end - start;
        if len == 1 {
            let byte = text[start] as usize;
            if self.bytes[byte].len_ids == 0 {
                let slot = self.remember(&text[start..end], [byte as u64, 0], out, tokenize)?;
                self.bytes[byte] = slot;
            } else {
                self.push(self.bytes[byte], out);
            }
            return Ok(());
        }
        if len > SHORT_BYTES {
            return self.long_ids_of(&text[start..end], out, tokenize);
        }
        let key = short_key(text, start, len);
        let hash = self.hash(key);
        let is_word = |s: &Short| s.key == key && s.len_ids & 0xff == len as u32;
        let set = &mut self.front[(hash >> 32) as usize % FRONT_SETS];
        if is_word(&set.0[0]) {
            let slot = set.0[0];
            self.push(slot, out);
            return Ok(());
        }
        if is_word(&set.0[1]) {
            set.0.swap(0, 1);
            let slot = set.0[0];
            self.push(slot, out);
            return Ok(());
        }
        let slot = match self.short.find(hash, is_word) {
            Some(&slot) => slot,
            None => {
                let slot = self.remember(&text[start..end], key, out, tokenize)?;
                let seeds = self.seeds;
                self.short.insert_unique(hash, slot, |s| hash_key(seeds, s.key));
                let set = &mut self.front[(hash >> 32) as usize % FRONT_SETS];
                set.0 = [slot, set.0[0]];
                return Ok(());
            }
        };
        let set = &mut self.front[(hash >> 32) as usize % FRONT_SETS];
        set.0 = [slot, set.0[0]];
        self.push(slot, out);
        Ok(())
    }

    #[inline(always)]
    fn hash(&self, key: [u64; 2]) -> u64 {
        hash_key(self.seeds, key)
    }

    #[inline(always)]
    fn push(&self, slot: Short, out: &mut Vec<u32>) {
        let n = (slot.len_ids >> 8) as usize;
        match n {
            1 => out.push(slot.ids[0]),
            ..=INLINE_IDS => out.extend_from_slice(&slot.ids[..n]),
            _ => out.extend_from_slice(&self.spilled[slot.ids[0] as usize..slot.ids[0] as usize + n]),
        }
    }

    /// A short word not in the memo: appends its ids from `tokenize`, and returns its slot.
    #[inline(never)]
    fn remember(
        &mut self,
        word: &[u8],
        key: [u64; 2],
        out: &mut Vec<u32>,
        tokenize: impl FnOnce(&[u8], &mut Vec<u32>) -> tokenizers::Result<()>,
    ) -> tokenizers::Result<Short> {
        let first = out.len();
        tokenize(word, out)?;
        self.make_room(SHORT_COST + 4 * (out.len() - first));
        let ids = &out[first..];
        let mut slot = Short { key, len_ids: word.len() as u32 | (ids.len() as u32) << 8, ids: [0; INLINE_IDS] };
        if ids.len() <= INLINE_IDS {
            slot.ids[..ids.len()].copy_from_slice(ids);
        } else {
            slot.ids[0] = self.spilled.len() as u32;
            self.spilled.extend_from_slice(ids);
        }
        Ok(slot)
    }

    #[inline(never)]
    fn long_ids_of(
        &mut self,
        word: &[u8],
        out: &mut Vec<u32>,
        tokenize: impl FnOnce(&[u8], &mut Vec<u32>) -> tokenizers::Result<()>,
    ) -> tokenizers::Result<()> {
        if let Some(&(at, n)) = self.long.get(word) {
            out.extend_from_slice(&self.long_ids[at as usize..(at + n) as usize]);
            return Ok(());
        }
        let first = out.len();
        tokenize(word, out)?;
        if word.len() > MAX_WORD_BYTES {
            return Ok(());
        }
        let n = out.len() - first;
        self.make_room(word.len() + 4 * n + LONG_OVERHEAD);
        let at = self.long_ids.len() as u32;
        self.long_ids.extend_from_slice(&out[first..]);
        self.long.insert(word.into(), (at, n as u32));
        Ok(())
    }

    /// Counts `cost` more bytes, emptying the memo first if they would pass the cap.
    fn make_room(&mut self, cost: usize) {
        if self.used_bytes + cost > self.cap_bytes {
            self.bytes.fill(Short::default());
            self.front.fill(Set::default());
            self.short.clear();
            self.spilled.clear();
            self.long.clear();
            self.long_ids.clear();
            self.used_bytes = 0;
        }
        self.used_bytes += cost;
    }
}

/// A folded 128-bit product of the seeded halves of the key (as foldhash mixes).
#[inline(always)]
fn hash_key(seeds: [u64; 2], key: [u64; 2]) -> u64 {
    let product = u128::from(key[0] ^ seeds[0]) * u128::from(key[1] ^ seeds[1]);
    (product as u64) ^ ((product >> 64) as u64)
}

/// The `len` (at most 16) bytes from `start` as two little-endian integers, zero-padded.
#[inline(always)]
fn short_key(text: &[u8], start: usize, len: usize) -> [u64; 2] {
    let (lo, hi) = match text.get(start..start + SHORT_BYTES) {
        Some(b) => (
            u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            u64::from_le_bytes(b[8..].try_into().expect("8 bytes")),
        ),
        None => {
            let mut buf = [0u8; SHORT_BYTES];
            buf[..len].copy_from_slice(&text[start..start + len]);
            (
                u64::from_le_bytes(buf[..8].try_into().expect("8 bytes")),
                u64::from_le_bytes(buf[8..].try_into().expect("8 bytes")),
            )
        }
    };
    let keep = |bytes: usize| if bytes >= 8 { u64::MAX } else { (1u64 << (8 * bytes)) - 1 };
    [lo & keep(len), hi & keep(len.saturating_sub(8))]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tokenizer stand-in that appends `ids`.
    fn tokens(ids: &[u32], out: &mut Vec<u32>) -> tokenizers::Result<()> {
        out.extend_from_slice(ids);
        Ok(())
    }

    #[test]
    fn keys_ignore_what_follows_the_word() {
        let text = b"abcdefghijklmnopqrstuvwxyz";
        for len in 0..=16 {
            let padded = short_key(&text[..len], 0, len);
            assert_eq!(short_key(text, 0, len), padded, "{len}");
            assert_eq!(short_key(text, 3, len.min(5)), short_key(&text[3..3 + len.min(5)], 0, len.min(5)));
        }
        // "a" and "a\0" share padded bytes; the length tells them apart
        let mut memo = WordIds::new(1 << 20);
        let mut out = Vec::new();
        memo.ids_of(b"a", 0, 1, &mut out, |_, out| tokens(&[1], out)).unwrap();
        memo.ids_of(b"a\0", 0, 2, &mut out, |_, out| tokens(&[2, 3], out)).unwrap();
        memo.ids_of(b"a\0", 0, 1, &mut out, |_, _| panic!("a is remembered")).unwrap();
        memo.ids_of(b"a\0", 0, 2, &mut out, |_, _| panic!("a\\0 is remembered")).unwrap();
        assert_eq!(out, [1, 2, 3, 1, 2, 3]);
    }

    #[test]
    fn ids_of_every_length_come_back() {
        let mut memo = WordIds::new(1 << 20);
        let words: Vec<Vec<u8>> = (1..300).map(|n| (0..n).map(|i| b'a' + (i % 26) as u8).collect()).collect();
        let ids = |w: &[u8]| -> Vec<u32> { (0..w.len().min(7) as u32).map(|i| i * 1000 + w.len() as u32).collect() };
        for round in 0..2 {
            for w in &words {
                let mut out = vec![9];
                memo.ids_of(w, 0, w.len(), &mut out, |word, out| {
                    assert!(round == 0 || w.len() > MAX_WORD_BYTES, "{} bytes asked again", w.len());
                    tokens(&ids(word), out)
                })
                .unwrap();
                assert_eq!(out[1..], ids(w)[..]);
            }
        }
    }

    #[test]
    fn a_full_memo_is_emptied_and_stays_under_its_cap() {
        let mut memo = WordIds::new(10_000);
        for i in 0..10_000u32 {
            let word = format!("w{i}");
            memo.ids_of(word.as_bytes(), 0, word.len(), &mut Vec::new(), |_, out| tokens(&[i], out)).unwrap();
            assert!(memo.used_bytes <= 10_000);
        }
        assert!(memo.short.len() < 10_000 / SHORT_COST + 1);
    }
}
