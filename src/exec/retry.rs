//! Retries: what the executor does after a failed attempt, by the stage's retry policy.

use std::collections::BTreeMap;
use std::time::Duration;

pub use crate::spec::RetryPolicy;
pub use mflow_contract::FailureClass;

/// What the executor should do after a failed attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    RetryAfter(Duration),
    GiveUp(String),
}

/// Per-stage retry bookkeeping: the budget used per class, and the checkpoint progress of
/// attempts, so that an attempt that advanced its checkpoint is free and two failures at the
/// same checkpoint stop the retries.
#[derive(Debug, Default)]
pub struct RetryState {
    used: BTreeMap<FailureClass, u32>,
    retries: u32,
    last_failed_checkpoint: Option<u64>,
}

impl RetryState {
    /// `before`/`after`: the newest checkpoint iteration before and after the attempt, when the
    /// stage reports one.
    pub fn on_failure(
        &mut self,
        policy: &RetryPolicy,
        class: FailureClass,
        before: Option<u64>,
        after: Option<u64>,
    ) -> Verdict {
        if !policy.on.contains(&class) {
            return Verdict::GiveUp(format!("{class} failures are not retried"));
        }
        let advanced = matches!((before, after), (b, Some(a)) if b.is_none_or(|b| a > b));
        if let Some(a) = after {
            if !advanced && self.last_failed_checkpoint == Some(a) {
                return Verdict::GiveUp(format!(
                    "failed twice at checkpoint iteration {a}; the failure is deterministic"
                ));
            }
            self.last_failed_checkpoint = Some(a);
        }
        if !advanced {
            let used = self.used.entry(class).or_default();
            if *used >= policy.max {
                return Verdict::GiveUp(format!("{class} retries exhausted ({} of {})", used, policy.max));
            }
            *used += 1;
        }
        let delay = backoff(policy, self.retries);
        self.retries += 1;
        Verdict::RetryAfter(delay)
    }
}

/// Exponential backoff with full jitter in [d/2, d], capped.
pub fn backoff(policy: &RetryPolicy, retry: u32) -> Duration {
    let base = policy.backoff.saturating_mul(1u32 << retry.min(16));
    let capped = base.min(policy.max_backoff);
    let half = capped / 2;
    half + Duration::from_secs_f64(half.as_secs_f64() * fastrand::f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(max: u32, on: &[FailureClass]) -> RetryPolicy {
        RetryPolicy { max, backoff: Duration::from_millis(10), max_backoff: Duration::from_millis(40), on: on.to_vec() }
    }

    #[test]
    fn budget_is_per_class() {
        let p = policy(1, &[FailureClass::Infra, FailureClass::User]);
        let mut s = RetryState::default();
        assert!(matches!(s.on_failure(&p, FailureClass::Infra, None, None), Verdict::RetryAfter(_)));
        assert!(matches!(s.on_failure(&p, FailureClass::User, None, None), Verdict::RetryAfter(_)));
        assert!(matches!(s.on_failure(&p, FailureClass::Infra, None, None), Verdict::GiveUp(_)));
    }

    #[test]
    fn classes_not_listed_are_not_retried() {
        let mut s = RetryState::default();
        assert!(matches!(
            s.on_failure(&policy(3, &[FailureClass::Infra]), FailureClass::User, None, None),
            Verdict::GiveUp(_)
        ));
    }

    #[test]
    fn advancing_checkpoints_are_free_and_repeats_stop() {
        let p = policy(1, &[FailureClass::User]);
        let mut s = RetryState::default();
        for (b, a) in [(None, Some(10)), (Some(10), Some(20)), (Some(20), Some(30))] {
            assert!(matches!(s.on_failure(&p, FailureClass::User, b, a), Verdict::RetryAfter(_)));
        }
        // Same checkpoint again: uses the budget once, then stops as deterministic.
        assert!(matches!(s.on_failure(&p, FailureClass::User, Some(30), Some(30)), Verdict::GiveUp(_)));
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        let p = policy(5, &[]);
        for r in 0..8 {
            let d = backoff(&p, r);
            assert!(d <= Duration::from_millis(40));
            assert!(d >= Duration::from_millis(5));
        }
    }
}
