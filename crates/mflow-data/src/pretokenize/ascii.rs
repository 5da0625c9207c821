//! GPT-2's pre-tokens in ASCII text, 64 bytes at a time: where words start, as a bit mask
//! computed from masks of the bytes' classes, instead of one branchy step per word (words
//! average about 3 bytes, and the steps' branches are hard to predict).
//!
//! The rules, for ASCII (the scanner's `gpt2` spells out the same alternatives one by one):
//! - a run of letters, of digits, or of other characters is one word, with the space before it
//!   if there is one;
//! - a run of white space ends at the end of the text, or before its last character when a word
//!   follows (that character is a word of its own, or the space of the next word);
//! - a word that starts with an apostrophe followed by s, t, m, d, re, ve or ll is those bytes.

use super::classes::{Classes, LETTER, NUMBER, OTHER, SPACE};

const BLOCK: usize = 64;

/// Whether the classes of ASCII bytes are those [`class`] computes (they are, for the patterns'
/// engine; checked rather than assumed).
pub(super) fn classes_agree(classes: &Classes) -> bool {
    (0..128u8).all(|b| classes.ascii(b) == class(b))
}

/// The class of an ASCII byte by arithmetic, as [`masks`] computes it for eight bytes at once.
#[inline(always)]
fn class(b: u8) -> u8 {
    if is_letter(b) {
        LETTER
    } else if is_digit(b) {
        NUMBER
    } else if is_space(b) {
        SPACE
    } else {
        OTHER
    }
}

#[inline(always)]
fn is_letter(b: u8) -> bool {
    (b | 0x20).wrapping_sub(b'a') < 26
}

#[inline(always)]
fn is_digit(b: u8) -> bool {
    b.wrapping_sub(b'0') < 10
}

/// Space, or \t \n \v \f \r.
#[inline(always)]
fn is_space(b: u8) -> bool {
    b == b' ' || b.wrapping_sub(b'\t') < 5
}

/// Masks of a block's bytes, bit k for byte k.
struct Masks {
    high: u64,
    letter: u64,
    number: u64,
    space: u64,
    blank: u64,
    apostrophe: u64,
}

/// The same byte in every lane of a word.
const fn lanes(b: u8) -> u64 {
    u64::from_le_bytes([b; 8])
}

const HIGH: u64 = lanes(0x80);

/// The masks of a block, eight bytes at a time (SWAR): each test leaves a lane's high bit set
/// where it holds. Lanes are cleared of their high bit first, so no sum carries into the next
/// lane; bytes that had it are not ASCII and are marked in `high`.
#[inline(always)]
fn masks(block: &[u8; BLOCK]) -> Masks {
    // lanes of at least `c`: (c <= 0x80; lanes below 0x80)
    let at_least = |x: u64, c: u8| (x + lanes(0x80 - c)) & HIGH;
    let equal = |x: u64, c: u8| !((x ^ lanes(c)) + lanes(0x7f)) & HIGH;
    // the high bits of the lanes as the eight bits of a byte, lane 0 lowest
    let gather = |m: u64| (m >> 7).wrapping_mul(0x0102_0408_1020_4080) >> 56;
    let mut masks = Masks { high: 0, letter: 0, number: 0, space: 0, blank: 0, apostrophe: 0 };
    for (j, chunk) in block.chunks_exact(8).enumerate() {
        let raw = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        let x = raw & !HIGH;
        let folded = x | lanes(0x20);
        let letter = at_least(folded, b'a') & !at_least(folded, b'z' + 1);
        let number = at_least(x, b'0') & !at_least(x, b'9' + 1);
        let blank = equal(x, b' ');
        let space = blank | (at_least(x, b'\t') & !at_least(x, b'\r' + 1));
        let shift = 8 * j;
        masks.high |= gather(raw & HIGH) << shift;
        masks.letter |= gather(letter) << shift;
        masks.number |= gather(number) << shift;
        masks.space |= gather(space) << shift;
        masks.blank |= gather(blank) << shift;
        masks.apostrophe |= gather(equal(x, b'\'')) << shift;
    }
    masks
}

/// The words that start in a block of ASCII text.
pub(super) struct Starts {
    /// Bit k: a word starts at the block's byte k (bit 0, where the block starts, is always set).
    pub(super) starts: u64,
    /// Starts below this are sure; a word that ends here or later may go on past the block.
    pub(super) sure: usize,
    /// The block ends the text: its last word ends there.
    pub(super) ends_text: bool,
}

/// The starts of words in the ASCII bytes from `i` (where a word starts) up to 64 bytes, or
/// None when the 8 bytes from `i` are not all ASCII (then one word is left to the scanner's
/// steps, so that text in other scripts does not pay for blocks it cannot use). Only for
/// classes that [`classes_agree`].
#[inline(always)]
pub(super) fn gpt2_starts(t: &[u8], i: usize) -> Option<Starts> {
    if t.get(i..i + 8).is_some_and(|head| u64::from_le_bytes(head.try_into().expect("8 bytes")) & HIGH != 0) {
        return None;
    }
    let Masks { high, letter, number, space, blank, apostrophe } = match t.get(i..i + BLOCK) {
        Some(block) => masks(block.try_into().expect("a block")),
        None => {
            let mut block = [0x80u8; BLOCK];
            block[..t.len() - i].copy_from_slice(&t[i..]);
            masks(&block)
        }
    };
    let ascii = high.trailing_zeros() as usize;
    let ends_text = ascii == t.len() - i;
    if ascii < 4 && !ends_text {
        return None;
    }
    let valid = if ascii == BLOCK { u64::MAX } else { (1u64 << ascii) - 1 };
    let [letter, number, space, blank, apostrophe] = [letter, number, space, blank, apostrophe].map(|m| m & valid);
    let other = valid & !(letter | number | space);
    // a class begins where the byte before is of another class
    let begins = |m: u64| m & !(m << 1);
    let runs = begins(letter) | begins(number) | begins(other);
    // white space: its first byte, and its last one before a word (not at the end of the text)
    let followed = valid >> 1;
    let space_starts = begins(space) | (space & !(space >> 1) & followed);
    // a run after a space starts with that space
    let mut starts = (runs & !(blank << 1)) | space_starts | 1;
    // contractions at word starts, in order: each ends a word 2 or 3 bytes on
    let mut candidates = starts & apostrophe;
    while candidates != 0 {
        let k = candidates.trailing_zeros() as usize;
        candidates &= candidates - 1;
        let len = match (t.get(i + k + 1), t.get(i + k + 2)) {
            (Some(b's' | b't' | b'm' | b'd'), _) => 2,
            (Some(b'r' | b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => 3,
            _ => continue,
        };
        if k + len < BLOCK {
            starts = (starts & !(((1u64 << len) - 2) << k)) | (1u64 << (k + len));
        } else {
            // it ends past the block: nothing after it is sure
            starts &= u64::MAX >> (BLOCK - 1 - k);
        }
    }
    // a start's place depends on the next byte, and a contraction on the two after it
    let sure = if ends_text { ascii } else { ascii - 2 };
    Some(Starts { starts: starts & valid, sure, ends_text })
}
