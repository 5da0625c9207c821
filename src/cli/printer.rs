//! Everything a command prints goes through the printer: text or JSON on standard output, and
//! notes on standard error. A closed pipe (`mflow plan SPEC | head -1`) is a clean end, never a
//! panic: what is left is dropped, and the command's exit code stays its own.

use std::cell::Cell;
use std::io::Write;

use super::args::OutputFormat;

pub struct Printer {
    format: OutputFormat,
    /// Notes are left out (`-q`); output a program reads and diagnostics are not.
    quiet: bool,
    /// Standard output went away (the reader of a pipe exited).
    closed: Cell<bool>,
}

impl Printer {
    pub fn new(format: OutputFormat, quiet: bool) -> Printer {
        Printer { format, quiet, closed: Cell::new(false) }
    }

    pub fn quiet(&self) -> bool {
        self.quiet
    }

    pub fn json(&self) -> bool {
        self.format == OutputFormat::Json
    }

    /// Text on standard output, as it is (add the line end).
    pub fn out(&self, text: &str) {
        if self.closed.get() {
            return;
        }
        let mut out = std::io::stdout().lock();
        if out.write_all(text.as_bytes()).and_then(|()| out.flush()).is_err() {
            self.closed.set(true);
        }
    }

    /// Whatever `write` writes, streamed to standard output; what it returns. A closed
    /// output ends the stream quietly.
    pub fn stream(&self, write: impl FnOnce(&mut dyn Write) -> std::io::Result<u64>) -> std::io::Result<u64> {
        if self.closed.get() {
            return Ok(0);
        }
        let mut out = std::io::stdout().lock();
        match write(&mut out).and_then(|n| out.flush().map(|()| n)) {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                self.closed.set(true);
                Ok(0)
            }
            r => r,
        }
    }

    /// One line on standard output.
    pub fn line(&self, text: impl AsRef<str>) {
        self.out(&format!("{}\n", text.as_ref()));
    }

    /// A value as one JSON document on standard output: pretty for a document, one line for a
    /// line of a stream (`compact`).
    pub fn value<T: serde::Serialize>(&self, v: &T, compact: bool) {
        let text = if compact { serde_json::to_string(v) } else { serde_json::to_string_pretty(v) };
        self.line(text.expect("output serializes"));
    }

    /// A note for people on standard error (never on standard output, which programs read).
    pub fn note(&self, text: impl AsRef<str>) {
        if self.quiet {
            return;
        }
        let _ = writeln!(std::io::stderr(), "{}", text.as_ref());
    }

    /// A diagnostic, as miette renders it, on standard error.
    pub fn diagnostic(&self, e: impl miette::Diagnostic + Send + Sync + 'static) {
        let _ = writeln!(std::io::stderr(), "{:?}", miette::Report::new(e));
    }
}
