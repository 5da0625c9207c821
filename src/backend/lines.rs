//! The way from a stage's pipes to the printer that makes its lines run events. Bounded: a
//! stage printing faster than mflow's own output is read waits on its full pipe rather than
//! growing mflow. In order: an attempt waits until every line it sent was said ([`Lines::said`])
//! before it says that it ended.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

use super::Line;

/// Bytes of lines on their way to the printer at most, all stages together.
const BUDGET: usize = 4 << 20;
/// What a line costs besides its text (its stage's name, the allocations).
const OVERHEAD: usize = 64;
/// Messages on their way at most.
const QUEUE: usize = 1024;

/// What the printer gets.
pub enum Printed {
    /// A line to say; the permit is its share of [`BUDGET`], given back once it is said.
    Line(Line, OwnedSemaphorePermit),
    /// Answered once every message sent before it was handled.
    Said(oneshot::Sender<()>),
}

/// The sending side, one clone per pipe.
#[derive(Clone)]
pub struct Lines {
    tx: mpsc::Sender<Printed>,
    budget: Arc<Semaphore>,
}

impl Lines {
    /// The sending side and the printer's.
    pub fn channel() -> (Lines, mpsc::Receiver<Printed>) {
        let (tx, rx) = mpsc::channel(QUEUE);
        (Lines { tx, budget: Arc::new(Semaphore::new(BUDGET)) }, rx)
    }

    /// Sends a line, waiting while the budget is spent. A line is dropped only when the
    /// printer is gone.
    pub async fn send(&self, line: Line) {
        let cost = (line.text.len() + OVERHEAD).min(BUDGET) as u32;
        let Ok(permit) = self.budget.clone().acquire_many_owned(cost).await else { return };
        let _ = self.tx.send(Printed::Line(line, permit)).await;
    }

    /// Returns once the printer has said every line sent before the call.
    pub async fn said(&self) {
        let (ack, done) = oneshot::channel();
        if self.tx.send(Printed::Said(ack)).await.is_ok() {
            let _ = done.await;
        }
    }
}
