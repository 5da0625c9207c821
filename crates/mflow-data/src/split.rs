//! Deterministic assignment of documents to the train / valid / test splits.
//!
//! Documents are numbered in corpus order and cut into blocks; each block holds exactly the
//! configured share of every split, in an order shuffled by a generator seeded from
//! `(seed, block number)`. The result depends only on the document number and the seed, never
//! on timing or thread count, and even small corpora get close to the requested ratios.

use miette::Diagnostic;
use serde::Serialize;
use thiserror::Error;

pub const SPLIT_NAMES: [&str; 3] = ["train", "valid", "test"];

/// Block size used when the ratios are not small whole numbers.
const DEFAULT_BLOCK: u32 = 1000;
const MAX_BLOCK: f64 = 10_000.0;

#[derive(Debug, Error, Diagnostic)]
pub enum SplitError {
    #[error("invalid --splits {value:?}: {reason}")]
    #[diagnostic(
        code(mflow::data::split::invalid),
        help("give three non-negative weights for train,valid,test, e.g. --splits 98,1,1 (at least one above zero)")
    )]
    Invalid { value: String, reason: String },
}

/// Relative weights of train, valid and test.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SplitRatios(pub [f64; 3]);

impl SplitRatios {
    pub fn parse(value: &str) -> Result<SplitRatios, SplitError> {
        let invalid = |reason: String| SplitError::Invalid { value: value.to_string(), reason };
        let parts: Vec<&str> = value.split(',').map(str::trim).collect();
        if parts.len() != 3 {
            return Err(invalid(format!("expected 3 comma-separated weights, found {}", parts.len())));
        }
        let mut w = [0f64; 3];
        for (slot, part) in w.iter_mut().zip(&parts) {
            let x: f64 = part.parse().map_err(|_| invalid(format!("{part:?} is not a number")))?;
            if !x.is_finite() || x < 0.0 {
                return Err(invalid(format!("{part:?} is not a finite non-negative number")));
            }
            *slot = x;
        }
        if w.iter().sum::<f64>() <= 0.0 {
            return Err(invalid("all weights are zero".into()));
        }
        Ok(SplitRatios(w))
    }

    /// How many documents of each split one block holds.
    fn block_counts(&self) -> [u32; 3] {
        let w = self.0;
        let sum: f64 = w.iter().sum();
        if w.iter().all(|x| x.fract() == 0.0) && sum <= MAX_BLOCK {
            return w.map(|x| x as u32);
        }
        // Scaled by the largest first: weights near f64::MAX would sum to infinity.
        let top = w.iter().copied().fold(0.0, f64::max);
        let w = w.map(|x| x / top);
        let sum: f64 = w.iter().sum();
        // largest remainder over a block of DEFAULT_BLOCK documents
        let exact = w.map(|x| x / sum * DEFAULT_BLOCK as f64);
        let mut counts = exact.map(|x| x.floor() as u32);
        let mut order = [0usize, 1, 2];
        order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())).then(a.cmp(&b)));
        let mut left = DEFAULT_BLOCK - counts.iter().sum::<u32>();
        for i in order.into_iter().cycle() {
            if left == 0 {
                break;
            }
            counts[i] += 1;
            left -= 1;
        }
        counts
    }
}

/// Hands out the split of consecutive documents.
pub struct SplitAssigner {
    seed: u64,
    counts: [u32; 3],
    block_index: u64,
    block: Vec<u8>,
    position: usize,
}

impl SplitAssigner {
    pub fn new(ratios: &SplitRatios, seed: u64) -> SplitAssigner {
        SplitAssigner { seed, counts: ratios.block_counts(), block_index: 0, block: Vec::new(), position: 0 }
    }

    /// Split (0 train, 1 valid, 2 test) of the next document.
    pub fn next_split(&mut self) -> u8 {
        if self.position == self.block.len() {
            self.fill_block();
        }
        let s = self.block[self.position];
        self.position += 1;
        s
    }

    fn fill_block(&mut self) {
        self.block.clear();
        for (split, &n) in self.counts.iter().enumerate() {
            self.block.extend(std::iter::repeat_n(split as u8, n as usize));
        }
        let mut key = [0u8; 16];
        key[..8].copy_from_slice(&self.seed.to_le_bytes());
        key[8..].copy_from_slice(&self.block_index.to_le_bytes());
        let mut rng = blake3::Hasher::new_derive_key("mflow dataset split v1");
        rng.update(&key);
        let mut stream = rng.finalize_xof();
        // Fisher-Yates with 64-bit draws; the modulo bias is below 2^-50 for blocks this small
        for i in (1..self.block.len()).rev() {
            let mut b = [0u8; 8];
            stream.fill(&mut b);
            let j = (u64::from_le_bytes(b) % (i as u64 + 1)) as usize;
            self.block.swap(i, j);
        }
        self.block_index += 1;
        self.position = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take(r: &str, seed: u64, n: usize) -> Vec<u8> {
        let mut a = SplitAssigner::new(&SplitRatios::parse(r).unwrap(), seed);
        (0..n).map(|_| a.next_split()).collect()
    }

    #[test]
    fn blocks_hold_exact_shares_and_depend_on_seed() {
        let v = take("98,1,1", 7, 1000);
        assert_eq!(v.iter().filter(|&&s| s == 1).count(), 10);
        assert_eq!(v.iter().filter(|&&s| s == 2).count(), 10);
        assert_eq!(v, take("98,1,1", 7, 1000));
        assert_ne!(v, take("98,1,1", 8, 1000));
    }

    #[test]
    fn fractional_weights_use_largest_remainder() {
        assert_eq!(SplitRatios::parse("0.9,0.05,0.05").unwrap().block_counts(), [900, 50, 50]);
        assert_eq!(SplitRatios::parse("1,1,1.5").unwrap().block_counts(), [286, 286, 428]);
        assert_eq!(SplitRatios::parse("1,0,0").unwrap().block_counts(), [1, 0, 0]);
        // weights whose sum is past f64::MAX, and tiny ones, keep their ratios
        assert_eq!(SplitRatios::parse("1e308,1e308,0").unwrap().block_counts(), [500, 500, 0]);
        assert_eq!(SplitRatios::parse("1.5e308,0,0.5e308").unwrap().block_counts(), [750, 0, 250]);
        assert_eq!(SplitRatios::parse("9e-320,1e-320,0").unwrap().block_counts(), [900, 100, 0]);
    }

    #[test]
    fn bad_ratios_are_rejected() {
        for bad in ["98,1", "a,1,1", "-1,1,1", "0,0,0", "inf,1,1"] {
            assert!(SplitRatios::parse(bad).is_err(), "{bad}");
        }
    }
}
