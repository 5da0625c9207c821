//! The JSON layout of run records: indented down to the second level, compact below it. A
//! 1000-stage lockfile is then a third smaller than fully indented JSON and much cheaper to
//! write, and a diff of two records still shows one line per changed stage.

use std::io::{self, Write};

use serde_json::ser::Formatter;

/// Containers nested deeper than this are written on one line.
const LINE_DEPTH: usize = 2;

#[derive(Default)]
pub struct Lines {
    depth: usize,
    has_value: bool,
}

impl Lines {
    fn open<W: ?Sized + Write>(&mut self, w: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.depth += 1;
        self.has_value = false;
        w.write_all(bracket)
    }

    fn close<W: ?Sized + Write>(&mut self, w: &mut W, bracket: &[u8]) -> io::Result<()> {
        let lined = self.depth <= LINE_DEPTH;
        self.depth -= 1;
        if lined && self.has_value {
            self.newline(w, self.depth)?;
        }
        w.write_all(bracket)
    }

    fn item<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if !first {
            w.write_all(b",")?;
        }
        if self.depth <= LINE_DEPTH {
            self.newline(w, self.depth)?;
        }
        Ok(())
    }

    fn newline<W: ?Sized + Write>(&self, w: &mut W, depth: usize) -> io::Result<()> {
        w.write_all(b"\n")?;
        for _ in 0..depth {
            w.write_all(b"  ")?;
        }
        Ok(())
    }
}

impl Formatter for Lines {
    fn begin_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"[")
    }
    fn end_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_array_value<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.item(w, first)
    }
    fn end_array_value<W: ?Sized + Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn begin_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"{")
    }
    fn end_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_object_key<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.item(w, first)
    }
    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(if self.depth <= LINE_DEPTH { b": " } else { b":" })
    }
    fn end_object_value<W: ?Sized + Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use serde::Serialize;

    fn lines(v: &impl Serialize) -> String {
        let mut out = Vec::new();
        v.serialize(&mut serde_json::Serializer::with_formatter(&mut out, super::Lines::default())).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn two_levels_indented_deeper_ones_compact() {
        let v = serde_json::json!({"id": "r1", "stages": {"a": {"key": "k", "attempts": [{"n": 1}]}, "b": {}}, "empty": [], "order": ["a", "b"]});
        let text = lines(&v);
        assert_eq!(
            text,
            "{\n  \"id\": \"r1\",\n  \"stages\": {\n    \"a\": {\"key\":\"k\",\"attempts\":[{\"n\":1}]},\n    \"b\": {}\n  },\n  \"empty\": [],\n  \"order\": [\n    \"a\",\n    \"b\"\n  ]\n}"
        );
        assert_eq!(serde_json::from_str::<serde_json::Value>(&text).unwrap(), v);
    }

    #[test]
    fn scalars_and_top_level_arrays() {
        assert_eq!(lines(&1), "1");
        assert_eq!(lines(&serde_json::json!([{"a": [1, 2]}, 3])), "[\n  {\n    \"a\": [1,2]\n  },\n  3\n]");
    }
}
