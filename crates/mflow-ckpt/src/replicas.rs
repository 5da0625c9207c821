//! The same weights held by several rank files: norms replicated over tensor-parallel ranks, and
//! a tied output layer, which the last pipeline stage keeps a copy of. Export and resharding
//! read one copy, so the others are checked to hold the same bytes first: a copy that drifted
//! (one rank's file changed, a training that let the copies part) would otherwise be dropped
//! in silence.

use std::collections::HashMap;

use crate::error::CkptError;
use crate::layout::{matrix, rank_key, RankPlan};
use crate::writer::Sources;

/// A region of a rank tensor: its key, first row and column.
type At = (String, u64, u64);

/// Every region that holds a Hugging Face region already held by an earlier rank tensor, with
/// that earlier region and the region's size: (hf tensor, first, copy, rows, cols).
fn copies(plans: &[RankPlan]) -> Vec<(String, At, At, u64, u64)> {
    let mut first: HashMap<(&str, [u64; 4]), At> = HashMap::new();
    let mut out = Vec::new();
    for rank in plans {
        for t in &rank.tensors {
            for p in &t.pieces {
                let Some(src) = &p.src else { continue };
                let at = (rank_key(rank.tp, rank.pp, &t.name), p.dst_row, p.dst_col);
                match first.entry((src.as_str(), [p.src_row, p.src_col, p.rows, p.cols])) {
                    std::collections::hash_map::Entry::Occupied(e) => {
                        out.push((src.clone(), e.get().clone(), at, p.rows, p.cols))
                    }
                    std::collections::hash_map::Entry::Vacant(e) => {
                        e.insert(at);
                    }
                }
            }
        }
    }
    out
}

/// Checks that every copy holds the bytes of the first.
pub fn check(plans: &[RankPlan], sources: &Sources) -> Result<(), CkptError> {
    for (hf, a, b, rows, cols) in copies(plans) {
        let region = |at: &At| -> Option<(String, Vec<&[u8]>)> {
            let (file, meta) = sources.get(&at.0)?;
            let e = meta.dtype.size() as u64;
            let (_, width) = matrix(&meta.shape);
            let bytes = file.bytes(meta);
            let lines = (0..rows)
                .map(|r| {
                    let from = (((at.1 + r) * width + at.2) * e) as usize;
                    bytes.get(from..from + (cols * e) as usize).unwrap_or(&[])
                })
                .collect();
            let name = sources.index.get(&at.0).map(|(_, n)| n.as_str()).unwrap_or_default();
            Some((format!("`{}` of {}", crate::untrusted::excerpt(name), file.path.display()), lines))
        };
        let (Some((first, x)), Some((copy, y))) = (region(&a), region(&b)) else { continue };
        if x != y {
            return Err(CkptError::Replicas { hf, first, copy });
        }
    }
    Ok(())
}
