//! How every diagnostic is shown: miette's handler, given a view of the diagnostic whose texts
//! are bounded. A message, help or label quotes what it took from a spec, a record or a
//! cluster; a value of megabytes there must not make a message of megabytes, whichever error
//! quotes it. Each text longer than [`MAX_TEXT`] keeps its start and its end (where the
//! message usually says what is wrong) around the size of what was left out. The spec's own
//! lines are cut where the spec is quoted (`spec::view`).

use std::fmt;

use miette::{Diagnostic, LabeledSpan, ReportHandler, Severity, SourceCode};

/// Bytes of one text of a diagnostic shown in full.
const MAX_TEXT: usize = 1200;
/// Of a longer text, the bytes shown from its start and from its end.
const HEAD: usize = 800;
const TAIL: usize = 240;

/// The handler that miette's hook installs: `inner` renders, on a bounded view.
pub struct Handler<H>(pub H);

impl<H: ReportHandler> ReportHandler for Handler<H> {
    fn debug(&self, error: &dyn Diagnostic, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.debug(&Bounded::of(error), f)
    }
}

/// `text` itself, or its start and end around the size of what is left out.
pub fn bounded(text: &str) -> String {
    if text.len() <= MAX_TEXT {
        return text.to_string();
    }
    let mut head = HEAD;
    while !text.is_char_boundary(head) {
        head -= 1;
    }
    let mut tail = text.len() - TAIL;
    while !text.is_char_boundary(tail) {
        tail += 1;
    }
    format!("{}… ({} bytes left out) …{}", &text[..head], tail - head, &text[tail..])
}

struct Bounded<'a> {
    inner: &'a dyn Diagnostic,
    message: String,
    help: Option<String>,
    related: Vec<Bounded<'a>>,
    cause: Option<Box<Bounded<'a>>>,
}

impl<'a> Bounded<'a> {
    fn of(inner: &'a dyn Diagnostic) -> Bounded<'a> {
        Bounded {
            inner,
            message: bounded(&inner.to_string()),
            help: inner.help().map(|h| bounded(&h.to_string())),
            related: inner.related().map(|r| r.map(Bounded::of).collect()).unwrap_or_default(),
            cause: inner.diagnostic_source().map(|d| Box::new(Bounded::of(d))),
        }
    }
}

impl fmt::Display for Bounded<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl fmt::Debug for Bounded<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Bounded<'_> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.inner.source()
    }
}

impl Diagnostic for Bounded<'_> {
    fn code<'b>(&'b self) -> Option<Box<dyn fmt::Display + 'b>> {
        self.inner.code()
    }

    fn severity(&self) -> Option<Severity> {
        self.inner.severity()
    }

    fn help<'b>(&'b self) -> Option<Box<dyn fmt::Display + 'b>> {
        self.help.as_ref().map(|h| Box::new(h) as Box<dyn fmt::Display + 'b>)
    }

    fn url<'b>(&'b self) -> Option<Box<dyn fmt::Display + 'b>> {
        self.inner.url()
    }

    fn source_code(&self) -> Option<&dyn SourceCode> {
        self.inner.source_code()
    }

    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        let labels = self.inner.labels()?.map(|l| {
            let text = l.label().map(bounded);
            if l.primary() {
                LabeledSpan::new_primary_with_span(text, *l.inner())
            } else {
                LabeledSpan::new_with_span(text, *l.inner())
            }
        });
        Some(Box::new(labels))
    }

    fn related<'b>(&'b self) -> Option<Box<dyn Iterator<Item = &'b dyn Diagnostic> + 'b>> {
        if self.related.is_empty() {
            return None;
        }
        Some(Box::new(self.related.iter().map(|r| r as &dyn Diagnostic)))
    }

    fn diagnostic_source(&self) -> Option<&dyn Diagnostic> {
        self.cause.as_deref().map(|c| c as &dyn Diagnostic)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_text_keeps_its_start_and_its_end() {
        let text = format!("input `{}` matches no file", "é".repeat(1_000_000));
        let shown = bounded(&text);
        assert!(shown.len() < MAX_TEXT + 100, "{}", shown.len());
        assert!(shown.starts_with("input `éé") && shown.ends_with("éé` matches no file"), "{shown}");
        assert!(shown.contains("bytes left out"));
        assert_eq!(bounded("short"), "short");
    }
}
