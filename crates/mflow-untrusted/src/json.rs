//! The shape of a JSON document someone else wrote, measured without building it.
//!
//! A JSON document held as a `serde_json::Value` takes from a few times its size (an index of
//! tensor names) to over a hundred (`[[[[]]]]` nested, where two bytes of text become a vector
//! of four values), and the `tokenizers` crate holds a tokenizer.json's model twice over while it
//! loads. [`shape`] reads the document once, as a stream, allocating nothing that grows with it
//! (its depth is bounded by the parser's recursion limit), and counts what it holds: values,
//! containers, string bytes, and for chosen paths (`model.vocab`) the same counts of the part
//! below them. [`Shape::value_bytes`] is what a `serde_json::Value` of the document holds, with
//! serde_json's own sizes, so that a reader can ask the memory budget before it parses.

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use crate::budget::{BadSetting, Budget, Need, OverBudget};

/// Counts of a document, or of the part of it below a path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Shape {
    /// null, true, false and numbers.
    pub scalars: u64,
    /// String values (keys not included).
    pub strings: u64,
    /// Object keys.
    pub keys: u64,
    /// Bytes of strings and keys, as decoded.
    pub string_bytes: u64,
    pub arrays: u64,
    pub objects: u64,
    /// Array elements and object entries.
    pub items: u64,
    /// What a `serde_json::Value` of this part holds on the heap (its root value excluded).
    pub value_bytes: u64,
    /// Containers inside containers, at most.
    pub depth: u32,
}

impl Shape {
    /// Values of every kind.
    pub fn values(&self) -> u64 {
        self.scalars + self.strings + self.arrays + self.objects
    }

    /// The heap of a `serde_json::Value` of the whole document, its root included.
    pub fn value_bytes(&self) -> u64 {
        self.value_bytes.saturating_add(std::mem::size_of::<serde_json::Value>() as u64)
    }

    fn add(&mut self, o: &Shape) {
        self.scalars += o.scalars;
        self.strings += o.strings;
        self.keys += o.keys;
        self.string_bytes += o.string_bytes;
        self.arrays += o.arrays;
        self.objects += o.objects;
        self.items += o.items;
        self.value_bytes = self.value_bytes.saturating_add(o.value_bytes);
    }
}

/// The shape of `bytes` as a JSON document, and of the parts at each of `paths` (object keys
/// from the root: `&["model", "vocab"]`; arrays on the way are passed through, so that
/// `&["added_tokens", "content"]` is the content of every added token); a part that is absent
/// has an empty shape. An error where `bytes` is not one JSON document (serde_json's own
/// message).
pub fn shape_at(bytes: &[u8], paths: &[&[&str]]) -> Result<(Shape, Vec<Shape>), serde_json::Error> {
    let mut walk = Walk { paths, parts: vec![Shape::default(); paths.len()], total: Shape::default() };
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let root = Node { walk: &mut walk, watching: (0..paths.len()).collect(), depth: 0, at: 0 };
    let root_depth = root.deserialize(&mut de)?;
    de.end()?;
    walk.total.depth = root_depth;
    Ok((walk.total, walk.parts))
}

/// [`shape_at`] without paths.
pub fn shape(bytes: &[u8]) -> Result<Shape, serde_json::Error> {
    shape_at(bytes, &[]).map(|(s, _)| s)
}

/// What a `Vec` of `n` pushed elements of `size` bytes holds (it doubles from 4).
pub fn vec_bytes(n: u64, size: u64) -> u64 {
    if n == 0 {
        return 0;
    }
    n.max(4).checked_next_power_of_two().unwrap_or(u64::MAX).saturating_mul(size)
}

/// What serde_json's object of `n` entries holds (an `IndexMap` when `preserve_order` is on, as
/// in mflow): a table of indices and a vector of entries, grown together.
fn map_bytes(n: u64) -> u64 {
    if n == 0 {
        return 0;
    }
    let value = std::mem::size_of::<serde_json::Value>() as u64;
    let key = std::mem::size_of::<String>() as u64;
    // hashbrown: buckets a power of two holding 7/8 of it (3 of 4), a control byte each.
    let buckets = (n.saturating_mul(8) / 7 + 1).max(4).checked_next_power_of_two().unwrap_or(u64::MAX);
    let capacity = if buckets == 4 { 3 } else { buckets / 8 * 7 };
    let table = buckets.saturating_mul(8 + 1).saturating_add(16);
    table.saturating_add(capacity.max(n).saturating_mul(8 + key + value))
}

/// Why [`parse`] gave no value.
#[derive(Debug)]
pub enum ParseError {
    /// The bytes are not one JSON document.
    Syntax(serde_json::Error),
    /// `MFLOW_MEMORY_BUDGET` is not an amount of memory.
    Setting(BadSetting),
    /// Holding the document would take more than the memory budget.
    OverBudget(OverBudget),
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParseError::Syntax(e) => write!(f, "not valid JSON: {e}"),
            ParseError::Setting(e) => e.fmt(f),
            ParseError::OverBudget(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for ParseError {}

/// Parses `bytes` into a `serde_json::Value` once the memory budget has agreed to what that will
/// hold: the text and the value ([`Shape::value_bytes`]), measured first.
pub fn parse(bytes: &[u8]) -> Result<serde_json::Value, ParseError> {
    parse_within(bytes, &Budget::from_env().map_err(ParseError::Setting)?)
}

/// [`parse`] within `budget`.
pub fn parse_within(bytes: &[u8], budget: &Budget) -> Result<serde_json::Value, ParseError> {
    let shape = shape(bytes).map_err(ParseError::Syntax)?;
    let mut need = Need::new();
    need.add("its text", bytes.len() as u64);
    need.add(
        format!(
            "{} values in {} arrays and {} objects, {} deep",
            shape.values(),
            shape.arrays,
            shape.objects,
            shape.depth
        ),
        shape.value_bytes(),
    );
    budget.check("parsing it", need).map_err(ParseError::OverBudget)?;
    serde_json::from_slice(bytes).map_err(ParseError::Syntax)
}

struct Walk<'p> {
    paths: &'p [&'p [&'p str]],
    parts: Vec<Shape>,
    total: Shape,
}

impl Walk<'_> {
    /// Adds `s` to the total and to every path this node is inside.
    fn count(&mut self, inside: &[usize], s: &Shape) {
        self.total.add(s);
        for &i in inside {
            self.parts[i].add(s);
        }
    }
}

/// A value at some depth: `watching` are the paths it is on the way to (or inside, when
/// `at` has reached their end).
struct Node<'w, 'p> {
    walk: &'w mut Walk<'p>,
    watching: Vec<usize>,
    depth: u32,
    /// Components of the watched paths matched so far.
    at: usize,
}

impl Node<'_, '_> {
    /// Paths whose whole length this node has matched.
    fn inside(&self) -> Vec<usize> {
        self.watching.iter().copied().filter(|&i| self.walk.paths[i].len() <= self.at).collect()
    }

    fn leaf(self, s: Shape) -> u32 {
        let inside = self.inside();
        self.walk.count(&inside, &s);
        self.depth
    }
}

impl<'de> DeserializeSeed<'de> for Node<'_, '_> {
    /// The deepest container depth below and at this node.
    type Value = u32;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<u32, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Node<'_, '_> {
    type Value = u32;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<u32, E> {
        Ok(self.leaf(Shape { scalars: 1, ..Shape::default() }))
    }
    fn visit_i64<E>(self, _: i64) -> Result<u32, E> {
        Ok(self.leaf(Shape { scalars: 1, ..Shape::default() }))
    }
    fn visit_u64<E>(self, _: u64) -> Result<u32, E> {
        Ok(self.leaf(Shape { scalars: 1, ..Shape::default() }))
    }
    fn visit_f64<E>(self, _: f64) -> Result<u32, E> {
        Ok(self.leaf(Shape { scalars: 1, ..Shape::default() }))
    }
    fn visit_unit<E>(self) -> Result<u32, E> {
        Ok(self.leaf(Shape { scalars: 1, ..Shape::default() }))
    }
    fn visit_str<E>(self, s: &str) -> Result<u32, E> {
        let n = s.len() as u64;
        Ok(self.leaf(Shape { strings: 1, string_bytes: n, value_bytes: n, ..Shape::default() }))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<u32, A::Error> {
        let inside = self.inside();
        let (walk, watching, depth, at) = (self.walk, self.watching, self.depth, self.at);
        let mut n = 0u64;
        let mut deepest = depth + 1;
        // Arrays are transparent to paths: their elements go on along the same paths.
        loop {
            let child = Node { walk: &mut *walk, watching: watching.clone(), depth: depth + 1, at };
            match seq.next_element_seed(child)? {
                Some(d) => deepest = deepest.max(d),
                None => break,
            }
            n += 1;
        }
        let value = std::mem::size_of::<serde_json::Value>() as u64;
        let s = Shape { arrays: 1, items: n, value_bytes: vec_bytes(n, value), ..Shape::default() };
        walk.count(&inside, &s);
        Ok(deepest)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<u32, A::Error> {
        let inside = self.inside();
        let (walk, watching, depth, at) = (self.walk, self.watching, self.depth, self.at);
        let mut n = 0u64;
        let mut deepest = depth + 1;
        while let Some(key) = map.next_key::<Key>()? {
            n += 1;
            let k = key.0.len() as u64;
            walk.count(&inside, &Shape { keys: 1, string_bytes: k, value_bytes: k, ..Shape::default() });
            // Paths still on the way continue below the key that is their next component.
            let next: Vec<usize> = watching
                .iter()
                .copied()
                .filter(|&i| {
                    let p = walk.paths[i];
                    p.len() <= at || (p[at] == key.0)
                })
                .collect();
            let child = Node { walk: &mut *walk, watching: next, depth: depth + 1, at: at + 1 };
            // A path already matched stays matched: `at` only grows past its length.
            deepest = deepest.max(map.next_value_seed(child)?);
        }
        let s = Shape { objects: 1, items: n, value_bytes: map_bytes(n), ..Shape::default() };
        walk.count(&inside, &s);
        Ok(deepest)
    }
}

/// An object key: borrowed from the text where it has no escapes, else a short-lived copy.
struct Key<'de>(std::borrow::Cow<'de, str>);

impl<'de> serde::Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Key<'de>, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object key")
            }
            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(std::borrow::Cow::Borrowed(s)))
            }
            fn visit_str<E>(self, s: &str) -> Result<Key<'de>, E> {
                Ok(Key(std::borrow::Cow::Owned(s.to_string())))
            }
        }
        d.deserialize_str(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_what_the_document_holds() {
        let doc = br#"{"model": {"type": "BPE", "vocab": {"a": 0, "bc": 1}, "merges": ["a b", ["b", "c"]]}, "added_tokens": [{"id": 2, "content": "<s>"}], "x": [[[]]]}"#;
        let (all, parts) =
            shape_at(doc, &[&["model", "vocab"], &["model", "merges"], &["added_tokens"], &["nothing", "here"]])
                .unwrap();
        assert_eq!(
            parts[0],
            Shape {
                scalars: 2,
                keys: 2,
                string_bytes: 3,
                objects: 1,
                items: 2,
                value_bytes: 3 + map_bytes(2),
                depth: 0,
                ..Shape::default()
            }
        );
        assert_eq!((parts[1].strings, parts[1].arrays, parts[1].items, parts[1].string_bytes), (3, 2, 4, 5));
        assert_eq!((parts[2].objects, parts[2].keys, parts[2].scalars, parts[2].strings), (1, 2, 1, 1));
        assert_eq!(parts[3], Shape::default());
        let (_, contents) = shape_at(doc, &[&["added_tokens", "content"]]).unwrap();
        assert_eq!((contents[0].strings, contents[0].string_bytes, contents[0].scalars), (1, 3, 0));
        assert_eq!(all.objects, 4);
        assert_eq!(all.arrays, 6);
        assert_eq!(all.depth, 4);
        assert_eq!((all.scalars, all.strings, all.values()), (3, 5, 18));
    }

    #[test]
    fn a_document_that_is_not_json_is_an_error() {
        for bad in [&b""[..], b"{", b"[1,]", b"{} {}", b"\xff"] {
            assert!(shape(bad).is_err(), "{bad:?}");
        }
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        assert!(shape(deep.as_bytes()).unwrap_err().to_string().contains("recursion limit"));
    }

    #[test]
    fn parse_asks_the_budget_first() {
        let budget = Budget::parse("64MiB").unwrap();
        assert_eq!(parse_within(br#"{"a": [1, 2]}"#, &budget).unwrap(), serde_json::json!({"a": [1, 2]}));
        assert!(matches!(parse_within(b"{", &budget), Err(ParseError::Syntax(_))));
        // 2 MB of nested arrays would hold 290 MB as a value: refused before any of it is made.
        let doc = format!("[{}[]]", "[[[[[[[[[[]]]]]]]]]],".repeat(100_000));
        let s = shape(doc.as_bytes()).unwrap();
        assert!(s.value_bytes() > 100 * doc.len() as u64, "{s:?}");
        let (e, peak) = crate::counting::peak_of(|| parse_within(doc.as_bytes(), &budget));
        assert_eq!(
            e.unwrap_err().to_string(),
            format!(
                "parsing it would need about {} of memory (1000002 values in 1000002 arrays and 0 objects, 11 deep: {}; \
                 its text: 2.0 MiB), more than the memory budget of 64.0 MiB (MFLOW_MEMORY_BUDGET)",
                crate::budget::bytes(s.value_bytes() + doc.len() as u64),
                crate::budget::bytes(s.value_bytes())
            )
        );
        assert!(peak < 64 << 10, "{peak} bytes held at most");
    }

    /// The estimate against what serde_json holds, counted by the allocator of this test.
    #[test]
    fn value_bytes_is_what_serde_json_holds() {
        for doc in [
            format!("[{}0]", "0,".repeat(100_000)),
            format!("[{}[]]", "[[[[1]]]],".repeat(20_000)),
            {
                let mut s = String::from("{");
                for i in 0..50_000 {
                    s.push_str(&format!("\"key{i}\":\"value {i}\","));
                }
                s.push_str("\"x\":{}}");
                s
            },
            r#"{"a": {"b": {"c": [1, 2, 3, "four"]}}, "e": "\u00e9\n"}"#.to_string(),
        ] {
            let estimate = shape(doc.as_bytes()).unwrap().value_bytes();
            let held = crate::counting::heap_of(|| serde_json::from_str::<serde_json::Value>(&doc).unwrap());
            assert!(
                held as f64 <= estimate as f64 * 1.05 && estimate as f64 <= held as f64 * 1.3,
                "estimate {estimate}, held {held}: {}",
                &doc[..60.min(doc.len())]
            );
        }
    }
}
