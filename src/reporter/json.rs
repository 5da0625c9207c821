//! `--output-format json`: every event as one line of JSON on standard output, in the format of
//! `mflow_contract::event::EventLine` (versioned, with the run id and the time).

use std::io::Write;

use mflow_contract::event::{RunEvent, FORMAT};
use mflow_contract::record::RunRecord;

use super::{Reporter, Stamp};

pub struct JsonLines {
    out: std::io::BufWriter<std::io::Stdout>,
    /// Standard output was closed (a reader that went away): the run goes on without it.
    closed: bool,
}

impl JsonLines {
    pub fn new() -> JsonLines {
        JsonLines { out: std::io::BufWriter::new(std::io::stdout()), closed: false }
    }
}

impl Default for JsonLines {
    fn default() -> Self {
        JsonLines::new()
    }
}

#[derive(serde::Serialize)]
struct Line<'a> {
    v: u32,
    run: &'a str,
    time: &'a str,
    #[serde(flatten)]
    event: &'a RunEvent,
}

impl Reporter for JsonLines {
    fn event(&mut self, run: &str, at: &Stamp, ev: &RunEvent, _record: &RunRecord) {
        if self.closed {
            return;
        }
        let line = Line { v: FORMAT, run, time: at.get(), event: ev };
        let written = serde_json::to_writer(&mut self.out, &line).map_err(std::io::Error::other).and_then(|()| {
            self.out.write_all(b"\n")?;
            // Cache hits of a large no-op run go out together; everything else at once.
            if !matches!(ev, RunEvent::StageCached { .. } | RunEvent::StageKeyed { .. }) {
                self.out.flush()?;
            }
            Ok(())
        });
        self.closed = written.is_err();
    }

    fn text(&mut self, line: &str) {
        // Not an event: a diagnostic, which goes where diagnostics go.
        let _ = writeln!(std::io::stderr(), "{line}");
    }

    fn flush(&mut self) {
        if !self.closed {
            self.closed = self.out.flush().is_err();
        }
    }

    fn finish(&mut self, _record: &RunRecord) {
        if !self.closed {
            let _ = self.out.flush();
        }
    }
}
