//! Code-point classes of the byte-level split patterns (`\p{L}`, `\p{N}`, `\s`, and the
//! case-folds of the contraction letters), as the tokenizer's own regex engine (Oniguruma, inside
//! the `tokenizers` crate) defines them.
//!
//! Exactness hangs on these tables rather than on the scanning algorithm: two Unicode versions
//! disagree on code points such as U+A7CF. The ranges in `unicode.rs` were read off the engine
//! by `derive_tables` (in the tests), and a test derives them again and fails when the engine's answer
//! differs (regenerate with `UPDATE_UNICODE_CLASSES=1 cargo test -p mflow-data unicode`).

use std::sync::OnceLock;

use super::unicode;

pub(crate) const LETTER: u8 = 0;
pub(crate) const NUMBER: u8 = 1;
pub(crate) const SPACE: u8 = 2;
/// Neither a letter, a number nor white space: `[^\s\p{L}\p{N}]`.
pub(crate) const OTHER: u8 = 3;

const CODE_POINTS: usize = 0x11_0000;
const BLOCK: usize = 256;

/// Class of every code point: a two-level table (a block per 256 code points, equal blocks
/// shared), about 40 KB in all.
pub(crate) struct Classes {
    ascii: [u8; 128],
    block_of: Vec<u16>,
    blocks: Vec<[u8; BLOCK]>,
}

impl Classes {
    /// The table of the shipped ranges, built once per process (well under a millisecond).
    pub(crate) fn get() -> &'static Classes {
        static TABLE: OnceLock<Classes> = OnceLock::new();
        TABLE.get_or_init(|| Classes::from_ranges(unicode::LETTER, unicode::NUMBER, unicode::SPACE))
    }

    fn from_ranges(letter: &[(u32, u32)], number: &[(u32, u32)], space: &[(u32, u32)]) -> Classes {
        let mut flat = vec![OTHER; CODE_POINTS];
        for (ranges, class) in [(letter, LETTER), (number, NUMBER), (space, SPACE)] {
            for &(lo, hi) in ranges {
                flat[lo as usize..=hi as usize].fill(class);
            }
        }
        let mut index = std::collections::HashMap::new();
        let (mut block_of, mut blocks) = (Vec::with_capacity(CODE_POINTS / BLOCK), Vec::new());
        for chunk in flat.chunks_exact(BLOCK) {
            let block: [u8; BLOCK] = chunk.try_into().expect("chunks of BLOCK");
            let id = *index.entry(block).or_insert_with(|| {
                blocks.push(block);
                blocks.len() as u16 - 1
            });
            block_of.push(id);
        }
        let mut ascii = [OTHER; 128];
        ascii.copy_from_slice(&flat[..128]);
        Classes { ascii, block_of, blocks }
    }

    #[inline(always)]
    pub(crate) fn ascii(&self, byte: u8) -> u8 {
        self.ascii[byte as usize & 0x7f]
    }

    #[inline(always)]
    pub(crate) fn of(&self, cp: u32) -> u8 {
        let cp = cp as usize;
        self.blocks[self.block_of[cp / BLOCK] as usize][cp % BLOCK]
    }

    /// Class and UTF-8 length of the character that starts at `i` of valid UTF-8 `text`.
    #[inline(always)]
    pub(crate) fn at(&self, text: &[u8], i: usize) -> (u8, usize) {
        let b = text[i];
        if b < 0x80 {
            return (self.ascii(b), 1);
        }
        let (cp, len) = decode(text, i);
        (self.of(cp), len)
    }
}

/// The code point and UTF-8 length of the character at `i` of valid UTF-8 (not ASCII).
#[inline(always)]
pub(crate) fn decode(text: &[u8], i: usize) -> (u32, usize) {
    let b = text[i] as u32;
    let cont = |k: usize| (text[i + k] & 0x3f) as u32;
    if b < 0xe0 {
        (((b & 0x1f) << 6) | cont(1), 2)
    } else if b < 0xf0 {
        (((b & 0x0f) << 12) | (cont(1) << 6) | cont(2), 3)
    } else {
        (((b & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3), 4)
    }
}

/// Whether `c` matches `(?i:letter)` in the regex engine; `letter` is one of the contraction
/// letters (`s t r e v m l d`).
pub(crate) fn folds_to(c: char, letter: char) -> bool {
    unicode::FOLDS.iter().any(|(l, set)| *l == letter && set.contains(&c))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ranges of `\p{L}`, `\p{N}` and `\s`, and the `(?i:x)` set of each contraction letter, as
    /// the `tokenizers` crate's regex engine matches them. Fails if the classes overlap, or if a
    /// single character matches a two-letter contraction (then the scanner would not be exact).
    fn derive_tables() -> Result<DerivedTables, String> {
        use tokenizers::utils::SysRegex;
        let all: String = (0..=0x10FFFFu32).filter_map(char::from_u32).collect();
        let matched = |pattern: &str| -> Result<Vec<char>, String> {
            let re = SysRegex::new(pattern).map_err(|e| format!("{pattern}: {e}"))?;
            Ok(re.find_iter(&all).flat_map(|(s, e)| all[s..e].chars()).collect())
        };
        let ranges = |pattern: &str| -> Result<Vec<(u32, u32)>, String> {
            let mut out: Vec<(u32, u32)> = Vec::new();
            for c in matched(pattern)? {
                match out.last_mut() {
                    Some((_, hi)) if *hi + 1 == c as u32 => *hi = c as u32,
                    _ => out.push((c as u32, c as u32)),
                }
            }
            Ok(out)
        };
        let tables = DerivedTables {
            letter: ranges(r"\p{L}+")?,
            number: ranges(r"\p{N}+")?,
            space: ranges(r"\s+")?,
            folds: "strevmld"
                .chars()
                .map(|l| Ok((l, matched(&format!("(?i:{l})+"))?)))
                .collect::<Result<_, String>>()?,
        };
        let mut seen = vec![false; CODE_POINTS];
        for (lo, hi) in tables.letter.iter().chain(&tables.number).chain(&tables.space) {
            for cp in *lo..=*hi {
                if std::mem::replace(&mut seen[cp as usize], true) {
                    return Err(format!("U+{cp:04X} is in two of \\p{{L}}, \\p{{N}}, \\s"));
                }
            }
        }
        if let Some(c) = matched("(?i:re|ve|ll)")?.first() {
            return Err(format!("{c:?} matches a two-letter contraction on its own"));
        }
        Ok(tables)
    }

    /// What `derive_tables` reads off the regex engine.
    #[derive(Debug, PartialEq)]
    struct DerivedTables {
        letter: Vec<(u32, u32)>,
        number: Vec<(u32, u32)>,
        space: Vec<(u32, u32)>,
        folds: Vec<(char, Vec<char>)>,
    }

    impl DerivedTables {
        /// The tables as shipped in `unicode.rs`.
        fn shipped() -> DerivedTables {
            DerivedTables {
                letter: unicode::LETTER.to_vec(),
                number: unicode::NUMBER.to_vec(),
                space: unicode::SPACE.to_vec(),
                folds: unicode::FOLDS.iter().map(|(l, s)| (*l, s.to_vec())).collect(),
            }
        }

        /// `unicode.rs` holding these tables.
        fn to_source(&self) -> String {
            let ranges = |name: &str, what: &str, r: &[(u32, u32)]| {
                let mut s =
                    format!("/// {what}: inclusive code-point ranges.\npub(super) const {name}: &[(u32, u32)] = &[\n");
                for line in r.chunks(6) {
                    let items: Vec<String> = line.iter().map(|(lo, hi)| format!("(0x{lo:04X}, 0x{hi:04X})")).collect();
                    s.push_str(&format!("    {},\n", items.join(", ")));
                }
                s + "];\n\n"
            };
            let mut s = String::from(
                "// Generated from the regex engine of the `tokenizers` crate by `classes::derive_tables`\n\
                 // (UPDATE_UNICODE_CLASSES=1 cargo test -p mflow-data unicode). Do not edit.\n\n",
            );
            s += &ranges("LETTER", r"`\p{L}`", &self.letter);
            s += &ranges("NUMBER", r"`\p{N}`", &self.number);
            s += &ranges("SPACE", r"`\s`", &self.space);
            s += "/// Each contraction letter and the characters `(?i:letter)` matches.\npub(super) const FOLDS: &[(char, &[char])] = &[\n";
            for (l, set) in &self.folds {
                let chars: Vec<String> = set.iter().map(|c| format!("'\\u{{{:x}}}'", *c as u32)).collect();
                s += &format!("    ('{l}', &[{}]),\n", chars.join(", "));
            }
            s + "];\n"
        }
    }

    /// The shipped tables are the engine's; with UPDATE_UNICODE_CLASSES=1 they are rewritten.
    #[test]
    fn unicode_classes_are_the_regex_engines() {
        let derived = derive_tables().expect("the engine's classes suit the scanner");
        if std::env::var_os("UPDATE_UNICODE_CLASSES").is_some() {
            let path = concat!(env!("CARGO_MANIFEST_DIR"), "/src/pretokenize/unicode.rs");
            std::fs::write(path, derived.to_source()).unwrap();
            return;
        }
        assert!(
            derived == DerivedTables::shipped(),
            "the regex engine's Unicode classes changed: regenerate src/pretokenize/unicode.rs with UPDATE_UNICODE_CLASSES=1"
        );
    }

    #[test]
    fn lookups_agree_with_the_ranges_everywhere() {
        let t = Classes::get();
        let shipped = DerivedTables::shipped();
        let in_ranges = |r: &[(u32, u32)], cp: u32| r.iter().any(|&(lo, hi)| lo <= cp && cp <= hi);
        for cp in (0..0x11_0000u32).step_by(7).chain([0x41, 0xA7CF, 0x10FFFF, 0x3000, 0x85, 0xA0]) {
            let want = if in_ranges(&shipped.letter, cp) {
                LETTER
            } else if in_ranges(&shipped.number, cp) {
                NUMBER
            } else if in_ranges(&shipped.space, cp) {
                SPACE
            } else {
                OTHER
            };
            assert_eq!(t.of(cp), want, "U+{cp:04X}");
        }
        for c in ['a', 'é', '中', '😀', '\u{10FFFF}'] {
            let mut buf = [0u8; 4];
            let s = c.encode_utf8(&mut buf);
            assert_eq!(t.at(s.as_bytes(), 0), (t.of(c as u32), c.len_utf8()));
        }
        assert!(folds_to('\u{17f}', 's') && folds_to('S', 's') && !folds_to('s', 't'));
    }
}
