//! What a diagnostic shows of the spec. miette quotes every line a label covers, in full, and
//! the lines around it: a 10 MB value on one line (or a string of a million lines) would be
//! quoted whole, once per problem. So a diagnostic is rendered from a view of the spec in which
//! every long line is cut to its start and its size, with its labels moved to match and held
//! to one line; line numbers stay those of the file. The values of credential keys are masked in
//! the view ([`super::secret::masked`]): a diagnostic quotes the lines around its label too.

use std::sync::Arc;

use miette::{LabeledSpan, SourceSpan};

/// Bytes of a line a diagnostic shows; the rest is replaced by its size.
const MAX_LINE: usize = 160;

/// Where the view replaces part of a line: the bytes `from..to` of the spec, shown as a
/// marker that starts at `at` in the view.
struct Cut {
    from: usize,
    to: usize,
    at: usize,
    marker: usize,
    /// Bytes removed by this cut and those before it.
    removed: usize,
}

pub struct View {
    /// The text the diagnostic shows: the spec, or the spec with its long lines cut and its
    /// credentials masked.
    text: Arc<str>,
    cuts: Vec<Cut>,
    masked: bool,
}

impl View {
    pub fn of(original: &Arc<str>) -> View {
        let masked = super::secret::masked(original);
        let spec: &str = masked.as_deref().unwrap_or(original);
        let mut cuts = Vec::new();
        let (mut shown, mut copied, mut removed, mut start) = (String::new(), 0, 0, 0);
        for line in spec.split_inclusive('\n') {
            let content = line.trim_end_matches(['\n', '\r']).len();
            if content > MAX_LINE {
                let mut keep = MAX_LINE;
                while !line.is_char_boundary(keep) {
                    keep -= 1;
                }
                let (from, to) = (start + keep, start + content);
                let marker = format!("… ({content} bytes in this line)");
                // A line barely over the bound stays whole: its marker would be longer than the cut.
                if to - from > marker.len() {
                    shown.push_str(&spec[copied..from]);
                    removed += (to - from) - marker.len();
                    cuts.push(Cut { from, to, at: shown.len(), marker: marker.len(), removed });
                    shown.push_str(&marker);
                    copied = to;
                }
            }
            start += line.len();
        }
        if cuts.is_empty() && masked.is_none() {
            return View { text: original.clone(), cuts, masked: false };
        }
        shown.push_str(&spec[copied..]);
        View { text: Arc::from(shown), cuts, masked: masked.is_some() }
    }

    /// The text to render, when it differs from the spec.
    pub fn text(&self) -> Option<&Arc<str>> {
        (self.masked || !self.cuts.is_empty()).then_some(&self.text)
    }

    /// Where offset `off` of the spec is in the view: inside a cut, at the cut's marker.
    fn offset(&self, off: usize) -> usize {
        let before = self.cuts.partition_point(|c| c.to <= off);
        let removed = if before == 0 { 0 } else { self.cuts[before - 1].removed };
        match self.cuts.get(before) {
            Some(c) if c.from <= off => c.at,
            _ => off - removed,
        }
    }

    /// A span of the spec as the view shows it: moved past the cuts before it, and ended at
    /// the end of its first line (through a marker it meets).
    pub fn span(&self, span: SourceSpan) -> SourceSpan {
        let (from, to) = (span.offset(), span.offset() + span.len());
        let start = self.offset(from).min(self.text.len());
        let mut end = self.offset(to).clamp(start, self.text.len());
        if let Some(c) = self.cuts.iter().find(|c| c.from <= to && to <= c.to && c.from < to) {
            end = end.max(c.at + c.marker);
        }
        let line_end = self.text[start..].find('\n').map_or(self.text.len(), |i| start + i);
        SourceSpan::new(start.into(), end.min(line_end.max(start)) - start)
    }

    pub fn label(&self, l: &LabeledSpan) -> LabeledSpan {
        let span = self.span(*l.inner());
        if l.primary() {
            LabeledSpan::new_primary_with_span(l.label().map(str::to_string), span)
        } else {
            LabeledSpan::new_with_span(l.label().map(str::to_string), span)
        }
    }
}

/// The place of `value` among the strings of stage `stage`'s table (at any depth: a list of
/// inputs, a kind's path), else of the stage's name, quoted from the spec as diagnostics show
/// it (long lines cut, credentials masked). None when the spec names no such stage.
pub fn place_of_value(spec: &super::Spec, stage: &str, value: &str) -> Option<(super::Src, SourceSpan)> {
    use super::tree::{Node, Val};
    fn find<'a>(n: &'a Node, value: &str) -> Option<&'a Node> {
        match &n.value {
            Val::Str(s) if !value.is_empty() && (s == value || s.contains(value)) => Some(n),
            Val::Array(items) => items.iter().find_map(|i| find(i, value)),
            Val::Table(entries) => entries.iter().find_map(|(_, v)| find(v, value)),
            _ => None,
        }
    }
    let root = super::tree::parse(&spec.source).ok()?;
    let stages = root.get("stages")?;
    let range = match stages.get(stage).and_then(|t| find(t, value)).and_then(Node::span) {
        Some(r) => r,
        None => stages.get_key(stage)?.origin.span()?,
    };
    let view = View::of(&spec.source);
    let span = view.span(SourceSpan::from(range));
    let text = view.text().cloned().unwrap_or_else(|| spec.source.clone());
    Some((miette::NamedSource::new(spec.path.display().to_string(), text), span))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(text: &str, span: std::ops::Range<usize>) -> (String, String) {
        let v = View::of(&Arc::from(text));
        let s = v.span(SourceSpan::from(span));
        let t = v.text().cloned().unwrap_or_else(|| Arc::from(text));
        (t.to_string(), t[s.offset()..s.offset() + s.len()].to_string())
    }

    #[test]
    fn a_long_line_is_cut_and_its_label_moves_with_it() {
        let long = "x".repeat(10_000);
        let text = format!("a = 1\nkind = \"{long}\"\nrun = [\"true\"]\n");
        let kind = text.find("kind").unwrap();
        let (view, label) = shown(&text, kind + 7..kind + 9 + long.len());
        assert!(view.len() < 400, "{view}");
        assert_eq!(view.lines().count(), 3);
        assert!(label.starts_with("\"xxx") && label.ends_with("(10009 bytes in this line)"), "{label}");
        // A label after the cut keeps its text.
        let run = text.find("run").unwrap();
        assert_eq!(shown(&text, run..run + 3).1, "run");
        // One inside the cut points at the marker.
        assert!(shown(&text, kind + 5000..kind + 5001).1.starts_with('…'));
    }

    #[test]
    fn a_label_over_many_lines_ends_with_its_first() {
        let text = format!("a = \"\"\"\n{}\"\"\"\nb = 2\n", "line\n".repeat(100_000));
        let (view, label) = shown(&text, 4..text.len() - 7);
        assert_eq!(view, text, "no line is long: nothing is cut");
        assert_eq!(label, "\"\"\"");
    }

    #[test]
    fn a_line_barely_over_the_bound_is_shown_whole() {
        for n in [MAX_LINE + 1, MAX_LINE + 10, MAX_LINE + 30] {
            let text = format!("k = \"{}\"\nb = 2\n", "y".repeat(n));
            let (view, label) = shown(&text, 4..text.find('\n').unwrap());
            assert!(view.len() <= text.len(), "the view is never longer than the spec");
            assert!(label.starts_with("\"yyy"), "{label}");
        }
    }

    #[test]
    fn characters_are_not_split() {
        let text = format!("k = \"{}\"\n", "é".repeat(5_000));
        let (view, label) = shown(&text, 4..text.len() - 1);
        assert!(view.len() < 400 && label.contains("bytes in this line"), "{view}");
    }
}
