//! A stage's progress: the events it appends to its `MFLOW_PROGRESS` file, followed while it
//! runs and emitted as run events with an ETA.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mflow_contract::event::RunEvent;
use mflow_contract::workload::Progress;

use super::Shared;
use crate::untrusted::PROGRESS_PIECE;

/// Follows attempt `attempt`'s progress file and emits its newest event, with the ETA of the
/// work left.
pub(super) async fn watch(path: PathBuf, stage: String, attempt: u32, sh: Arc<Shared>) {
    let t0 = Instant::now();
    let mut offset = 0u64;
    // An attempt warms up again and is timed from its own start.
    let mut rate = Rate::default();
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        // Only what was appended since the last look, a bounded piece at a time.
        let p = path.clone();
        let Ok((new, size)) =
            crate::untrusted::blocking(move || crate::untrusted::read_from(&p, offset, PROGRESS_PIECE)).await
        else {
            continue;
        };
        if new.is_empty() {
            continue;
        }
        let end = new.iter().rposition(|&b| b == b'\n').map(|p| p + 1).unwrap_or(0);
        // A piece without a line end, as large as a piece can be, is skipped rather than waited on.
        let end = if end == 0 && new.len() as u64 == PROGRESS_PIECE { new.len() } else { end };
        offset += end as u64;
        if offset < size.saturating_sub(PROGRESS_PIECE) {
            // Far behind: only the newest events matter.
            offset = size - PROGRESS_PIECE;
            continue;
        }
        let newest = std::str::from_utf8(&new[..end]).ok().and_then(|s| s.lines().rev().find_map(Progress::parse));
        if let Some(p) = newest {
            let elapsed = t0.elapsed().as_secs_f64();
            // A count is never shown above its total.
            let done = p.total.map_or(p.done, |t| p.done.min(t));
            let eta_s = rate.observe(done, p.total, elapsed).map(f64::round);
            sh.emit(RunEvent::Progress {
                stage: stage.clone(),
                attempt,
                label: p.label,
                done,
                total: p.total,
                unit: p.unit,
                message: p.message,
                elapsed_s: elapsed,
                eta_s,
            });
        }
    }
}

/// Events with new work past the first one that an ETA needs: one step is noise, and the second
/// can still be slow (a second compilation, data loader workers filling their queues).
const MIN_STEPS: u32 = 3;

/// Seconds over which older steps fade out of the rate (an exponential moving average over
/// time): long enough to smooth noisy steps, short enough to follow a rate that changes.
const RATE_WINDOW_S: f64 = 120.0;

/// A stage's rate of progress, without its warm-up. The time to a stage's first counted step
/// includes compiling, loading data and the rendezvous: an ETA from it was 3h for a 4-minute
/// stage. So the rate is measured from the first event with work done, as the ratio of two
/// decayed sums (work done and seconds taken) over the events since.
#[derive(Debug, Default)]
struct Rate {
    /// `done` and elapsed seconds of the newest counted event.
    last: Option<(u64, f64)>,
    done: f64,
    secs: f64,
    /// Events past the first that counted more work.
    steps: u32,
}

impl Rate {
    /// Takes an event's count at `elapsed` seconds into the attempt; the seconds left, once
    /// there is evidence enough.
    fn observe(&mut self, done: u64, total: Option<u64>, elapsed: f64) -> Option<f64> {
        match self.last {
            // Counting restarted (a new attempt whose start was not announced): measure anew.
            Some((d, t)) if done < d || elapsed < t => *self = Rate::default(),
            _ => {}
        }
        match self.last {
            None if done > 0 => self.last = Some((done, elapsed)),
            None => {}
            Some((d, t)) if done > d => {
                let dt = elapsed - t;
                let keep = (-dt / RATE_WINDOW_S).exp();
                self.done = self.done * keep + (done - d) as f64;
                self.secs = self.secs * keep + dt;
                self.steps += 1;
                self.last = Some((done, elapsed));
            }
            // The same count with a new message: the time runs on into the next step.
            Some(_) => {}
        }
        let left = total?.checked_sub(done).filter(|&l| l > 0)?;
        (self.steps >= MIN_STEPS && self.secs > 0.0 && self.done > 0.0).then(|| self.secs / self.done * left as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (done, elapsed seconds) events of one attempt, and the ETA after each.
    fn etas(events: &[(u64, f64)], total: u64) -> Vec<Option<f64>> {
        let mut r = Rate::default();
        events.iter().map(|&(d, t)| r.observe(d, Some(total), t)).collect()
    }

    #[test]
    fn a_slow_first_step_does_not_set_the_eta() {
        // Step 1 takes 60 s (compiling, loading), every step after it 1 s.
        let events: Vec<(u64, f64)> = (1..=20).map(|i| (i, 59.0 + i as f64)).collect();
        let e = etas(&events, 200);
        assert_eq!(e[..3], [None, None, None], "no ETA before three steps past the first");
        for (i, eta) in e.iter().enumerate().skip(3) {
            let left = (200 - events[i].0) as f64;
            let eta = eta.unwrap_or_else(|| panic!("an ETA at step {}", i + 1));
            assert!((eta - left).abs() < 0.01 * left, "step {}: ETA {eta} s for {left} steps of 1 s", i + 1);
        }
    }

    #[test]
    fn the_eta_follows_a_changed_rate_and_survives_skipped_events() {
        // Events are read 4 times a second, so some are never seen: 5 steps per event here.
        let mut events: Vec<(u64, f64)> = vec![(0, 0.5), (5, 30.0)];
        events.extend((2..=40).map(|i| (5 * i, 30.0 + 5.0 * (i - 1) as f64)));
        // Then each step takes 2 s for ten minutes.
        events.extend((1..=60).map(|i| (200 + 5 * i, 225.0 + 10.0 * i as f64)));
        let e = etas(&events, 1000);
        assert_eq!(e[40], Some(800.0), "1 s a step");
        let eta = e.last().unwrap().unwrap();
        let left = 1000.0 - 500.0;
        assert!((eta - 2.0 * left).abs() < 0.05 * 2.0 * left, "ETA {eta} s for {left} steps of 2 s");
    }

    #[test]
    fn an_event_without_new_work_or_a_restart_is_no_evidence() {
        let mut r = Rate::default();
        assert_eq!(r.observe(0, Some(10), 1.0), None, "nothing done yet");
        // A new message at the same count is no step.
        for (d, t) in [(1, 40.0), (1, 40.5), (2, 41.0), (3, 42.0)] {
            assert_eq!(r.observe(d, Some(10), t), None);
        }
        assert_eq!(r.observe(4, Some(10), 43.0), Some(6.0));
        assert_eq!(r.observe(10, Some(10), 50.0), None, "nothing left");
        // A new attempt counts from 0 again, and warms up again.
        assert_eq!(r.observe(1, Some(10), 30.0), None);
        assert_eq!(r.observe(4, Some(10), 33.0), None);
        assert_eq!(r.observe(2, None, 1.0), None, "no total");
    }
}
