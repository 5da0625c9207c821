//! A shard plan turned around ([`invert`]: for every Hugging Face tensor, the pieces of rank
//! tensors that hold it), and a new plan composed with it ([`compose`]), for export and
//! resharding.

use std::collections::{BTreeMap, HashSet};

use crate::layout::{matrix, rank_key, Piece, RankPlan};

/// Turns a shard plan around: for every Hugging Face tensor, the pieces of rank tensors (keyed
/// by [`rank_key`]) that hold it. Replicated copies are read once. Returns an error message if
/// some element is not covered, which would be a bug in [`shard_plan`].
pub fn invert(plans: &[RankPlan], hf: &[(String, Vec<u64>)]) -> Result<BTreeMap<String, Vec<Piece>>, String> {
    // Each source's pieces, and the rectangles among them (a replicated tensor is read from one
    // rank: the others hold the same rectangle).
    type Kept = (Vec<Piece>, HashSet<[u64; 4]>);
    let mut by_src: BTreeMap<&str, Kept> = BTreeMap::new();
    for rank in plans {
        for t in &rank.tensors {
            let key = rank_key(rank.tp, rank.pp, &t.name);
            for p in &t.pieces {
                let Some(src) = &p.src else { continue };
                let (rows, cols) = if p.transpose { (p.cols, p.rows) } else { (p.rows, p.cols) };
                let (kept, rects) = by_src.entry(src.as_str()).or_default();
                if rects.insert([p.src_row, p.src_col, rows, cols]) {
                    kept.push(Piece {
                        src: Some(key.clone()),
                        src_row: p.dst_row,
                        src_col: p.dst_col,
                        dst_row: p.src_row,
                        dst_col: p.src_col,
                        rows,
                        cols,
                        transpose: p.transpose,
                    });
                }
            }
        }
    }
    let mut out = BTreeMap::new();
    for (name, shape) in hf {
        let pieces = by_src.remove(name.as_str()).map(|(kept, _)| kept).unwrap_or_default();
        let (r, c) = matrix(shape);
        let area: u64 = pieces.iter().map(|p| p.rows * p.cols).sum();
        if area != r * c {
            return Err(format!("tensor {name}: plan covers {area} of {} elements", r * c));
        }
        out.insert(name.clone(), pieces);
    }
    Ok(out)
}

/// The inverse of a plan ([`invert`]) arranged for [`compose`]: each logical tensor's pieces in
/// order along the axis they split it on, so that the pieces a region overlaps are found by a
/// search instead of a pass over all of them (a fused QKV of thousands of groups would make
/// resharding quadratic).
pub struct Inverse {
    tensors: BTreeMap<String, Along>,
}

/// A logical tensor's pieces sorted by where they start on the axis that splits it, and the
/// longest of them along it.
struct Along {
    pieces: Vec<Piece>,
    by_cols: bool,
    longest: u64,
}

impl Along {
    fn start(&self, q: &Piece) -> u64 {
        if self.by_cols {
            q.dst_col
        } else {
            q.dst_row
        }
    }
}

impl Inverse {
    pub fn new(logical: BTreeMap<String, Vec<Piece>>) -> Inverse {
        let tensors = logical
            .into_iter()
            .map(|(name, mut pieces)| {
                // Pieces that all span the same rows split the tensor by columns.
                let by_cols = pieces.windows(2).all(|w| (w[0].dst_row, w[0].rows) == (w[1].dst_row, w[1].rows));
                let along =
                    |q: &Piece| if by_cols { (q.dst_col, q.dst_row, q.cols) } else { (q.dst_row, q.dst_col, q.rows) };
                pieces.sort_by_key(|q| (along(q).0, along(q).1));
                let longest = pieces.iter().map(|q| along(q).2).max().unwrap_or(0);
                (name, Along { pieces, by_cols, longest })
            })
            .collect();
        Inverse { tensors }
    }

    /// The pieces of `name` that may overlap rows `rows` and columns `cols`: a piece that starts
    /// before the region by the longest piece's length or more, or at or after its end, cannot.
    fn near(&self, name: &str, rows: std::ops::Range<u64>, cols: std::ops::Range<u64>) -> &[Piece] {
        let Some(t) = self.tensors.get(name) else { return &[] };
        let span = if t.by_cols { cols } else { rows };
        let lo = t.pieces.partition_point(|q| t.start(q).saturating_add(t.longest) <= span.start);
        let hi = t.pieces.partition_point(|q| t.start(q) < span.end);
        &t.pieces[lo..hi.max(lo)]
    }
}

/// Rewrites a piece that reads a logical tensor into pieces that read that tensor's own sources.
pub fn compose(p: &Piece, logical: &Inverse) -> Vec<Piece> {
    let Some(src) = &p.src else { return vec![p.clone()] };
    // The region of the logical tensor that `p` reads, in logical coordinates.
    let (lr, lc) = if p.transpose { (p.cols, p.rows) } else { (p.rows, p.cols) };
    let mut out = Vec::new();
    for q in logical.near(src, p.src_row..p.src_row + lr, p.src_col..p.src_col + lc) {
        let r0 = p.src_row.max(q.dst_row);
        let r1 = (p.src_row + lr).min(q.dst_row + q.rows);
        let c0 = p.src_col.max(q.dst_col);
        let c1 = (p.src_col + lc).min(q.dst_col + q.cols);
        if r0 >= r1 || c0 >= c1 {
            continue;
        }
        // Position of the overlap inside p's destination.
        let (dr, dc, rows, cols) = if p.transpose {
            (p.dst_row + (c0 - p.src_col), p.dst_col + (r0 - p.src_row), c1 - c0, r1 - r0)
        } else {
            (p.dst_row + (r0 - p.src_row), p.dst_col + (c0 - p.src_col), r1 - r0, c1 - c0)
        };
        // Position of the overlap inside q's source.
        let (sr, sc) = if q.transpose {
            (q.src_row + (c0 - q.dst_col), q.src_col + (r0 - q.dst_row))
        } else {
            (q.src_row + (r0 - q.dst_row), q.src_col + (c0 - q.dst_col))
        };
        out.push(Piece {
            src: q.src.clone(),
            src_row: sr,
            src_col: sc,
            dst_row: dr,
            dst_col: dc,
            rows,
            cols,
            transpose: p.transpose != q.transpose,
        });
    }
    out
}
