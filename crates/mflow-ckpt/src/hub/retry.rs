//! Trying a Hub request again: exponential backoff with jitter, for failures that may pass (the
//! network, 429, 5xx, a cut transfer), never for a wrong name, revision or token.

use std::time::Duration;

use rand::Rng;

use crate::error::CkptError;
use crate::hub::HubError;

/// How often, and how far apart, a failed request is tried again.
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    /// Tries in all, the first included.
    pub attempts: u32,
    /// The wait after the first failure; each next one doubles, up to `max`.
    pub base: Duration,
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff { attempts: 5, base: Duration::from_secs(1), max: Duration::from_secs(30) }
    }
}

impl Backoff {
    /// The wait after failure `n` (0-based): between half and all of `base * 2^n` (at most
    /// `max`), at random, so that the parallel downloads of a file list, or the stages of many
    /// runs, do not come back at the same instant.
    pub fn delay(&self, n: u32, rng: &mut impl Rng) -> Duration {
        let full = self.base.saturating_mul(1u32 << n.min(16)).min(self.max);
        let half = full / 2;
        half + full.saturating_sub(half).mul_f64(rng.gen::<f64>())
    }

    /// Runs `op` until it succeeds, fails for good, or has been tried `attempts` times.
    pub fn run<T>(&self, mut op: impl FnMut() -> Result<T, CkptError>) -> Result<T, CkptError> {
        let mut rng = rand::thread_rng();
        let mut n = 0;
        loop {
            match op() {
                Err(e) if passing(&e) && n + 1 < self.attempts.max(1) => {
                    std::thread::sleep(self.delay(n, &mut rng));
                    n += 1;
                }
                done => return done,
            }
        }
    }
}

/// Whether `e` may pass if asked again.
pub fn passing(e: &CkptError) -> bool {
    match e {
        CkptError::Hub(HubError::Http { .. } | HubError::Size { .. }) => true,
        CkptError::Hub(HubError::Status { status, .. }) => *status == 408 || *status == 429 || *status >= 500,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn each_wait_is_between_half_and_all_of_a_doubling_step_and_they_differ() {
        let b = Backoff { attempts: 9, base: Duration::from_millis(100), max: Duration::from_secs(3) };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for n in 0..8 {
            let full = Duration::from_millis(100 << n).min(b.max);
            let waits: Vec<Duration> = (0..200).map(|_| b.delay(n, &mut rng)).collect();
            assert!(waits.iter().all(|w| *w >= full / 2 && *w <= full), "{n}: {waits:?}");
            let (lo, hi) = (waits.iter().min().unwrap(), waits.iter().max().unwrap());
            assert!(*hi - *lo > full / 4, "{n}: jitter spreads the waits: {lo:?}..{hi:?}");
        }
        assert_eq!(b.delay(40, &mut rng).max(b.max), b.max);
    }
}
