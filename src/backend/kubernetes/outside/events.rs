//! The events of a driver in the cluster, read back from its log as the event type they were
//! written as, and handed to a dispatcher here: the laptop shows a run in the cluster as a local
//! run is shown (or passes its JSON lines on).

use mflow_contract::event::EventLine;

use crate::reporter::console::{Console, Mode};
use crate::reporter::json::JsonLines;
use crate::reporter::{Dispatcher, Reporter};

pub struct Follower {
    dispatcher: Dispatcher,
}

impl Follower {
    pub fn new(mode: Mode) -> Follower {
        let reporter: Box<dyn Reporter> = match mode {
            Mode::Json => Box::new(JsonLines::new()),
            mode => Box::new(Console::new(mode)),
        };
        Follower { dispatcher: Dispatcher::new("", vec![reporter]) }
    }

    /// One line of the driver's log: an event, or anything else (a diagnostic), shown as it is.
    pub fn line(&self, line: &str) {
        match EventLine::parse(line) {
            Some(ev) => self.dispatcher.emit_line(ev),
            None => self.dispatcher.text(line),
        }
    }

    pub fn flush(&self) {
        self.dispatcher.flush();
    }

    pub fn finish(&self) {
        self.dispatcher.finish();
    }
}
