//! The split patterns of GPT-2 and Llama-3 as hand-written scanners: the same pre-tokens the
//! regex engine finds, without a regex engine. Each function below follows its pattern's
//! alternatives in order, with the backtracking the engine would do spelled out.
//!
//! ASCII is classified by a 128-entry table, other characters by [`Classes`]; nothing is
//! allocated. A [`Scanner`] is used only for a pattern it recognizes word for word. GPT-2's words
//! in ASCII text are found 64 bytes at a time ([`ascii`]); these steps do the rest.

use super::ascii;
use super::classes::{decode, folds_to, Classes, LETTER, NUMBER, OTHER, SPACE};

/// GPT-2's pattern, the one the `ByteLevel` pre-tokenizer uses with `use_regex`.
pub(crate) const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama-3's `Split` pattern (also used by several later byte-level tokenizers).
pub(crate) const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scheme {
    Gpt2,
    Llama3,
}

impl Scheme {
    pub(crate) fn for_pattern(pattern: &str) -> Option<Scheme> {
        match pattern {
            GPT2 => Some(Scheme::Gpt2),
            LLAMA3 => Some(Scheme::Llama3),
            _ => None,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Scheme::Gpt2 => "gpt2",
            Scheme::Llama3 => "llama3",
        }
    }
}

pub(crate) struct Scanner {
    scheme: Scheme,
    classes: &'static Classes,
    /// Whether GPT-2's words in ASCII text are found by bit masks ([`ascii`]).
    ascii_blocks: bool,
}

impl Scanner {
    pub(crate) fn new(scheme: Scheme) -> Scanner {
        let classes = Classes::get();
        Scanner { scheme, classes, ascii_blocks: scheme == Scheme::Gpt2 && ascii::classes_agree(classes) }
    }

    pub(crate) fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// Calls `word(start, end)` for each pre-token that starts in `text[from..to]`, in order;
    /// they tile it. `from` must start a pre-token; the last one may end past `to`.
    #[inline]
    pub(crate) fn for_each<E>(
        &self,
        text: &str,
        from: usize,
        to: usize,
        mut word: impl FnMut(usize, usize) -> Result<(), E>,
    ) -> Result<(), E> {
        let t = text.as_bytes();
        let mut i = from;
        match self.scheme {
            Scheme::Gpt2 => {
                while i < to {
                    if self.ascii_blocks {
                        let from = i;
                        i = ascii_words(t, i, to, &mut word)?;
                        if i > from {
                            continue;
                        }
                    }
                    let end = self.gpt2(t, i);
                    word(i, end)?;
                    i = end;
                }
            }
            Scheme::Llama3 => {
                while i < to {
                    let end = self.llama3(t, i);
                    word(i, end)?;
                    i = end;
                }
            }
        }
        Ok(())
    }

    /// Positions, about `every` bytes apart, where a pre-token starts whatever came before:
    /// after a line feed, before an ASCII letter. No alternative of either pattern carries a
    /// match from a line feed into a letter (a line feed is only ever matched with white space,
    /// or at the end of `[^\s\p{L}\p{N}]+[\r\n]*`), so the pieces between cuts can be scanned
    /// apart with [`Scanner::for_each`], each over the whole text for its lookahead.
    pub(crate) fn cuts(&self, text: &str, every: usize) -> Vec<usize> {
        let t = text.as_bytes();
        let mut cuts = Vec::new();
        let mut at = every;
        while at < t.len() {
            let Some(cut) = t[at..].windows(2).position(|w| w[0] == b'\n' && w[1].is_ascii_alphabetic()) else { break };
            cuts.push(at + cut + 1);
            at += cut + 1 + every;
        }
        cuts
    }

    /// End of the GPT-2 pre-token that starts at `i`.
    #[inline(always)]
    fn gpt2(&self, t: &[u8], i: usize) -> usize {
        let b = t[i];
        // 's|'t|'re|'ve|'m|'ll|'d
        if b == b'\'' {
            match (t.get(i + 1), t.get(i + 2)) {
                (Some(b's' | b't' | b'm' | b'd'), _) => return i + 2,
                (Some(b'r' | b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => return i + 3,
                _ => {}
            }
        }
        let (class, len) = self.classes.at(t, i);
        if class != SPACE {
            // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+` without the space
            return self.run(t, i + len, class);
        }
        if b == b' ' && i + 1 < t.len() {
            // the same three with the space
            let (next, next_len) = self.classes.at(t, i + 1);
            if next != SPACE {
                return self.run(t, i + 1 + next_len, next);
            }
        }
        self.space_run(t, i).trailing(t.len(), i)
    }

    /// End of the Llama-3 pre-token that starts at `i`.
    #[inline(always)]
    fn llama3(&self, t: &[u8], i: usize) -> usize {
        let b = t[i];
        if b == b'\'' {
            if let Some(end) = self.folded_contraction(t, i + 1) {
                return end;
            }
        }
        let (class, len) = self.classes.at(t, i);
        match class {
            // [^\r\n\p{L}\p{N}]?\p{L}+ without the optional character
            LETTER => return self.run(t, i + len, LETTER),
            // \p{N}{1,3}
            NUMBER => {
                let mut end = i + len;
                for _ in 0..2 {
                    match self.class_at(t, end) {
                        Some((NUMBER, l)) => end += l,
                        _ => break,
                    }
                }
                return end;
            }
            _ => {}
        }
        let newline = b == b'\r' || b == b'\n';
        // [^\r\n\p{L}\p{N}]?\p{L}+ with it
        if !newline {
            if let Some((LETTER, l)) = self.class_at(t, i + len) {
                return self.run(t, i + len + l, LETTER);
            }
        }
        // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
        let others_from = if class == OTHER {
            Some(i + len)
        } else if b == b' ' {
            match self.class_at(t, i + 1) {
                Some((OTHER, l)) => Some(i + 1 + l),
                _ => None,
            }
        } else {
            None
        };
        if let Some(from) = others_from {
            let mut end = self.run(t, from, OTHER);
            while end < t.len() && matches!(t[end], b'\r' | b'\n') {
                end += 1;
            }
            return end;
        }
        // `\s*[\r\n]+`: the run of white space up to its last CR or LF, if it holds one
        let run = self.space_run(t, i);
        if let Some(newline) = run.last_newline {
            return newline + 1;
        }
        run.trailing(t.len(), i)
    }

    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)` after the apostrophe, at `i`.
    fn folded_contraction(&self, t: &[u8], i: usize) -> Option<usize> {
        let (first, len) = self.char_at(t, i)?;
        if ['s', 't', 'm', 'd'].iter().any(|&l| folds_to(first, l)) {
            return Some(i + len);
        }
        let (second, len2) = self.char_at(t, i + len)?;
        let pair = [('r', 'e'), ('v', 'e'), ('l', 'l')].iter().any(|&(a, b)| folds_to(first, a) && folds_to(second, b));
        pair.then_some(i + len + len2)
    }

    /// End of the run of `class` characters from `i`.
    #[inline(always)]
    fn run(&self, t: &[u8], mut i: usize, class: u8) -> usize {
        while i < t.len() {
            let (here, len) = self.classes.at(t, i);
            if here != class {
                break;
            }
            i += len;
        }
        i
    }

    #[inline(always)]
    fn space_run(&self, t: &[u8], mut i: usize) -> SpaceRun {
        let mut run = SpaceRun { end: i, last_start: i, last_newline: None };
        while i < t.len() {
            let (class, len) = self.classes.at(t, i);
            if class != SPACE {
                break;
            }
            if matches!(t[i], b'\r' | b'\n') {
                run.last_newline = Some(i);
            }
            run.last_start = i;
            i += len;
        }
        run.end = i;
        run
    }

    #[inline(always)]
    fn class_at(&self, t: &[u8], i: usize) -> Option<(u8, usize)> {
        (i < t.len()).then(|| self.classes.at(t, i))
    }

    fn char_at(&self, t: &[u8], i: usize) -> Option<(char, usize)> {
        let b = *t.get(i)?;
        if b < 0x80 {
            return Some((b as char, 1));
        }
        let (cp, len) = decode(t, i);
        Some((char::from_u32(cp)?, len))
    }
}

/// Calls `word` on the words from `i` (a word start) that [`ascii::gpt2_starts`] is sure of, up
/// to `to`; returns where it stopped (`i` when it found none).
#[inline(always)]
fn ascii_words<E>(
    t: &[u8],
    mut i: usize,
    to: usize,
    word: &mut impl FnMut(usize, usize) -> Result<(), E>,
) -> Result<usize, E> {
    let Some(block) = ascii::gpt2_starts(t, i) else { return Ok(i) };
    let base = i;
    let mut later = block.starts & !1;
    while later != 0 && i < to {
        let next = base + later.trailing_zeros() as usize;
        if next - base >= block.sure {
            return Ok(i);
        }
        word(i, next)?;
        i = next;
        later &= later - 1;
    }
    if block.ends_text && i < to {
        word(i, t.len())?;
        i = t.len();
    }
    Ok(i)
}

/// A run of white space: where it ends, where its last character starts, its last CR or LF.
struct SpaceRun {
    end: usize,
    last_start: usize,
    last_newline: Option<usize>,
}

impl SpaceRun {
    /// `\s+(?!\S)|\s+` over the run that starts at `start`: all of it at the end of the text,
    /// else all but its last character (which goes with the word after it), else its only one.
    #[inline(always)]
    fn trailing(&self, len: usize, start: usize) -> usize {
        if self.end == len || self.last_start == start {
            self.end
        } else {
            self.last_start
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::utils::SysRegex;

    /// Pre-tokens of `text` as the regex engine cuts them (matches and the gaps between).
    fn by_regex(pattern: &str, text: &str) -> Vec<String> {
        let re = SysRegex::new(pattern).unwrap();
        let (mut out, mut prev) = (Vec::new(), 0);
        for (s, e) in re.find_iter(text) {
            if prev < s {
                out.push(text[prev..s].to_string());
            }
            if s < e {
                out.push(text[s..e].to_string());
            }
            prev = e;
        }
        if prev < text.len() {
            out.push(text[prev..].to_string());
        }
        out
    }

    fn by_scanner(scheme: Scheme, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        let _ = Scanner::new(scheme).for_each(text, 0, text.len(), |s, e| -> Result<(), ()> {
            out.push(text[s..e].to_string());
            Ok(())
        });
        out
    }

    fn same(text: &str) {
        for (scheme, pattern) in [(Scheme::Gpt2, GPT2), (Scheme::Llama3, LLAMA3)] {
            assert_eq!(by_scanner(scheme, text), by_regex(pattern, text), "{scheme:?} on {text:?}");
        }
    }

    #[test]
    fn scanners_cut_as_the_regex_engine() {
        for text in [
            "",
            " ",
            "  ",
            "a",
            "Hello world's  \n\t  x123 4567 ½ 中文字 can't 'LL 'RE 'Re  \u{a0}e\u{301}\u{200b} 🚀!!\r\n   end...  ",
            "don't I'M 'ſ 'S we'll they've you're 'd 'x '",
            "  foo",
            " \n foo",
            "\n\n\nx",
            "a\r\n\r\n  b",
            "x  \n",
            "1234567 12 ١٢٣٤ ½¾",
            "(foo) [bar]\n\n",
            "    fn main() {\n        let x = 1;\n    }\n",
            "a\u{3000}\u{3000}b",
            "\t\tfoo",
            ";;\r\n\r\nx",
            " ;\n",
            "e\u{301}\u{301} \u{301}",
            "\u{a7cf}\",",
            "\u{85}\u{85}x",
            "'\u{17f}t",
        ] {
            same(text);
        }
    }

    /// Random texts, mostly ASCII, of every length up to a few blocks: the bit-mask path cuts them
    /// as the scanner's one step per word does, and as the regex engine does.
    #[test]
    fn ascii_blocks_cut_as_word_by_word() {
        let fast = Scanner::new(Scheme::Gpt2);
        assert!(fast.ascii_blocks);
        let slow = Scanner { ascii_blocks: false, ..Scanner::new(Scheme::Gpt2) };
        let cut = |scanner: &Scanner, text: &str| {
            let mut out = Vec::new();
            let _ = scanner.for_each(text, 0, text.len(), |s, e| -> Result<(), ()> {
                out.push(text[s..e].to_string());
                Ok(())
            });
            out
        };
        let pieces = [
            "a", "Z", "q", "0", "7", " ", " ", "  ", "\n", "\t", "\r\n", "\x0b", "\x0c", "'", "'", "s", "t", "re",
            "ve", "ll", "m", "d", "e", "l", ".", "-", "_", "é", "\u{a0}", "\u{3000}", "\u{85}", "'s", "'ll", "'re",
            "'S", "\0", "\x1c", "\x7f", "@", "[", "`", "{", "/", ":", "9", "A",
        ];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut below = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        for round in 0..200_000 {
            let ascii_only = round % 2 == 0;
            let len = 1 + below(if round % 10 == 0 { 200 } else { 70 });
            let mut text = String::new();
            while text.len() < len {
                let piece = pieces[below(pieces.len())];
                if !ascii_only || piece.is_ascii() {
                    text.push_str(piece);
                }
            }
            let got = cut(&fast, &text);
            assert_eq!(got, cut(&slow, &text), "{text:?}");
            if round % 50 == 0 {
                assert_eq!(got, by_regex(GPT2, &text), "{text:?}");
            }
        }
    }

    #[test]
    fn pieces_between_cuts_scan_as_the_whole() {
        let mut text = String::new();
        for n in 0..4000 {
            text.push_str(
                ["x  \n", "\n\nab", " 'S\n", "\r\nQ", "؛\n", "\u{a0}\n", "12\n", "z", "\n ", ";\r\n"][n % 10],
            );
            text.push_str(["Hello", " world", "\tx", "..", "é", "\u{3000}"][n % 6]);
        }
        for scheme in [Scheme::Gpt2, Scheme::Llama3] {
            let scanner = Scanner::new(scheme);
            let whole = by_scanner(scheme, &text);
            for every in [1, 7, 100, 5000] {
                let cuts = scanner.cuts(&text, every);
                assert!(cuts.len() + 1 >= text.len() / (every + 64), "{scheme:?}: {} cuts every {every}", cuts.len());
                let mut bounds = vec![0];
                bounds.extend(&cuts);
                bounds.push(text.len());
                let mut pieces = Vec::new();
                for w in bounds.windows(2) {
                    let _ = scanner.for_each(&text, w[0], w[1], |s, e| -> Result<(), ()> {
                        assert!(e <= w[1], "{scheme:?}: a word crosses the cut at {}", w[1]);
                        pieces.push(text[s..e].to_string());
                        Ok(())
                    });
                }
                assert_eq!(pieces, whole, "{scheme:?} every {every}");
            }
        }
    }

    #[test]
    fn every_character_in_every_position() {
        // each code point after and before a letter, a digit, a space, a newline, punctuation
        let mut text = String::new();
        for (n, c) in (0..=0x10FFFFu32).filter_map(char::from_u32).enumerate() {
            let ctx = ["a", "1", " ", "\n", ".", "'", "  "][n % 7];
            text.push_str(ctx);
            text.push(c);
            if n % 3 == 0 {
                text.push(c);
            }
            if n % 5000 == 4999 {
                same(&text);
                text.clear();
            }
        }
        same(&text);
    }
}
