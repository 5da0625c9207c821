//! Which stages can be decided now: those whose upstream stages have all ended. Kept as
//! counts, so that a stage ending costs its own edges instead of a pass over the whole plan.

use std::collections::BTreeSet;

use super::StageEnd;
use crate::plan::Plan;

pub(super) struct Frontier {
    pub ends: Vec<Option<StageEnd>>,
    /// Upstream stages of each stage that have not ended yet.
    waiting_on: Vec<usize>,
    dependents: Vec<Vec<usize>>,
    /// Stages not started or ended whose upstream stages have all ended, in plan order.
    ready: BTreeSet<usize>,
}

impl Frontier {
    pub fn new(plan: &Plan) -> Frontier {
        let n = plan.stages.len();
        let mut dependents = vec![Vec::new(); n];
        for (i, s) in plan.stages.iter().enumerate() {
            for &d in &s.deps {
                dependents[d].push(i);
            }
        }
        let waiting_on: Vec<usize> = plan.stages.iter().map(|s| s.deps.len()).collect();
        let ready = (0..n).filter(|&i| waiting_on[i] == 0).collect();
        Frontier { ends: vec![None; n], waiting_on, dependents, ready }
    }

    /// The first ready stage at or after `from`. Stages that become ready meanwhile come
    /// after the one that ended (the plan is in dependency order), so one pass of
    /// `next(i + 1)` sees them too.
    pub fn next(&self, from: usize) -> Option<usize> {
        self.ready.range(from..).next().copied()
    }

    /// Stage `i` was handed to the backend.
    pub fn start(&mut self, i: usize) {
        self.ready.remove(&i);
    }

    /// Stage `i` ended; the stages waiting only for it become ready.
    pub fn end(&mut self, i: usize, end: StageEnd) {
        self.ready.remove(&i);
        self.ends[i] = Some(end);
        for &j in &self.dependents[i] {
            self.waiting_on[j] -= 1;
            if self.waiting_on[j] == 0 {
                self.ready.insert(j);
            }
        }
    }
}
