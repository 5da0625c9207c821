//! Where a run's events go. The executor emits typed events ([`RunEvent`]) into one
//! [`Dispatcher`], the only place that talks to reporters: it folds each event into the run
//! record, then hands both to every reporter in turn (the record writer, the console or the
//! JSON lines, JUnit and the CI step summary). The follower of a run in a cluster reads the same
//! events back and hands them to a dispatcher of its own.

pub mod console;
pub mod json;
mod warnings;

use std::sync::Mutex;

use mflow_contract::event::RunEvent;
use mflow_contract::record::{RunRecord, RunStatus};

/// The time of an event, formatted only when a reporter or the record asks for it: most
/// events of a large no-op run (stages keyed and found cached) need none.
pub struct Stamp(std::sync::OnceLock<String>);

impl Stamp {
    fn new() -> Stamp {
        Stamp(std::sync::OnceLock::new())
    }

    /// The time an event was stamped with where it happened (a driver in a cluster).
    fn at(time: String) -> Stamp {
        Stamp(std::sync::OnceLock::from(time))
    }

    pub fn get(&self) -> &str {
        self.0.get_or_init(crate::record::now)
    }
}

/// Something that reads the event stream.
pub trait Reporter: Send {
    /// One event, after the record took it in.
    fn event(&mut self, run: &str, at: &Stamp, ev: &RunEvent, record: &RunRecord);
    /// A line that is not an event (a diagnostic of a driver in a cluster), to be shown as it is.
    fn text(&mut self, _line: &str) {}
    /// Write out what is held back.
    fn flush(&mut self) {}
    /// The stream ended (after the last event); finish writing.
    fn finish(&mut self, _record: &RunRecord) {}
}

/// The only place that talks to reporters.
pub struct Dispatcher {
    inner: Mutex<Inner>,
}

struct Inner {
    record: RunRecord,
    reporters: Vec<Box<dyn Reporter>>,
}

impl Dispatcher {
    /// A dispatcher for run `run`, whose record starts empty and follows from the events.
    pub fn new(run: &str, reporters: Vec<Box<dyn Reporter>>) -> Dispatcher {
        Dispatcher { inner: Mutex::new(Inner { record: empty_record(run), reporters }) }
    }

    pub fn emit(&self, ev: RunEvent) {
        self.dispatch(Stamp::new(), None, ev)
    }

    /// An event read back from a stream (a driver's log), with its own run id and time.
    pub fn emit_line(&self, line: mflow_contract::event::EventLine) {
        self.dispatch(Stamp::at(line.time), Some(line.run), line.event)
    }

    fn dispatch(&self, at: Stamp, run: Option<String>, ev: RunEvent) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let Inner { record, reporters } = &mut *inner;
        if let Some(run) = run.filter(|r| *r != record.id) {
            record.id = run;
        }
        record.apply(&|| at.get().to_string(), &ev);
        for r in reporters.iter_mut() {
            r.event(&record.id, &at, &ev, record);
        }
    }

    /// A line that is not an event, shown as it is.
    pub fn text(&self, line: &str) {
        for r in self.inner.lock().unwrap_or_else(|e| e.into_inner()).reporters.iter_mut() {
            r.text(line);
        }
    }

    pub fn flush(&self) {
        for r in self.inner.lock().unwrap_or_else(|e| e.into_inner()).reporters.iter_mut() {
            r.flush();
        }
    }

    /// A copy of the record as it stands.
    pub fn snapshot(&self) -> RunRecord {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).record.clone()
    }

    /// Ends the stream: every reporter finishes and is dropped; the record is handed back.
    pub fn finish(&self) -> RunRecord {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut reporters = std::mem::take(&mut inner.reporters);
        for r in reporters.iter_mut() {
            r.finish(&inner.record);
        }
        std::mem::replace(&mut inner.record, empty_record(""))
    }
}

fn empty_record(run: &str) -> RunRecord {
    RunRecord {
        format: mflow_contract::record::FORMAT,
        id: run.to_string(),
        pipeline: String::new(),
        spec: String::new(),
        started: String::new(),
        finished: None,
        status: RunStatus::Running,
        exit_code: None,
        mflow_version: env!("CARGO_PKG_VERSION").into(),
        process: None,
        stages: Default::default(),
        order: vec![],
    }
}

impl crate::exec::EventSink for Dispatcher {
    fn emit(&self, ev: RunEvent) {
        Dispatcher::emit(self, ev)
    }
}
