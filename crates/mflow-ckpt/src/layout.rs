//! Where every element of every tensor comes from.
//!
//! One mapping is written by hand: how each Megatron per-rank tensor is assembled from blocks of
//! Hugging Face tensors ([`shard_plan`]). Export inverts it ([`invert`]) and resharding composes
//! the new plan with the inverse of the old one ([`compose`]). A tensor is viewed as a matrix:
//! 2-D tensors as they are, 1-D tensors as one column.

use std::collections::BTreeMap;

use crate::shape::{Architecture, ModelShape};

/// Copies a `rows x cols` block into a destination tensor. With `transpose`,
/// `dst[dst_row + i][dst_col + j] = src[src_row + j][src_col + i]`; without it,
/// `dst[dst_row + i][dst_col + j] = src[src_row + i][src_col + j]`. A `src` of `None` is zeros.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub src: Option<String>,
    pub src_row: u64,
    pub src_col: u64,
    pub dst_row: u64,
    pub dst_col: u64,
    pub rows: u64,
    pub cols: u64,
    pub transpose: bool,
}

/// A tensor to produce and the pieces it is made of.
#[derive(Debug, Clone)]
pub struct TensorPlan {
    pub name: String,
    pub shape: Vec<u64>,
    pub pieces: Vec<Piece>,
}

/// All tensors of one (tp, pp) rank file.
#[derive(Debug, Clone)]
pub struct RankPlan {
    pub tp: u32,
    pub pp: u32,
    pub tensors: Vec<TensorPlan>,
}

pub fn rank_file_name(tp: u32, pp: u32) -> String {
    format!("model_tp{tp:02}_pp{pp:03}.safetensors")
}

/// Matrix view `[rows, cols]` of a shape.
pub fn matrix(shape: &[u64]) -> (u64, u64) {
    match shape {
        [] => (1, 1),
        [n] => (*n, 1),
        [r, rest @ ..] => (*r, rest.iter().product()),
    }
}

/// Names of the Hugging Face tensors that make up a layer `i` (or the whole model) in order.
pub fn hf_tensors(s: &ModelShape) -> Vec<(String, Vec<u64>)> {
    let (h, v, ff) = (s.hidden_size, s.vocab_size, s.ffn_hidden_size);
    let q = s.num_attention_heads * s.kv_channels;
    let kv = s.num_query_groups * s.kv_channels;
    let mut out = Vec::new();
    let mut add = |n: String, shape: &[u64]| out.push((n, shape.to_vec()));
    match s.architecture {
        Architecture::Llama | Architecture::Qwen2 => {
            add("model.embed_tokens.weight".into(), &[v, h]);
            for i in 0..s.num_layers {
                let p = format!("model.layers.{i}.");
                add(format!("{p}input_layernorm.weight"), &[h]);
                add(format!("{p}self_attn.q_proj.weight"), &[q, h]);
                add(format!("{p}self_attn.k_proj.weight"), &[kv, h]);
                add(format!("{p}self_attn.v_proj.weight"), &[kv, h]);
                if s.add_qkv_bias {
                    add(format!("{p}self_attn.q_proj.bias"), &[q]);
                    add(format!("{p}self_attn.k_proj.bias"), &[kv]);
                    add(format!("{p}self_attn.v_proj.bias"), &[kv]);
                }
                add(format!("{p}self_attn.o_proj.weight"), &[h, q]);
                add(format!("{p}post_attention_layernorm.weight"), &[h]);
                add(format!("{p}mlp.gate_proj.weight"), &[ff, h]);
                add(format!("{p}mlp.up_proj.weight"), &[ff, h]);
                add(format!("{p}mlp.down_proj.weight"), &[h, ff]);
            }
            add("model.norm.weight".into(), &[h]);
        }
        Architecture::Gpt2 => {
            add("transformer.wte.weight".into(), &[v, h]);
            add("transformer.wpe.weight".into(), &[s.max_position_embeddings, h]);
            for i in 0..s.num_layers {
                let p = format!("transformer.h.{i}.");
                add(format!("{p}ln_1.weight"), &[h]);
                add(format!("{p}ln_1.bias"), &[h]);
                add(format!("{p}attn.c_attn.weight"), &[h, 3 * h]);
                add(format!("{p}attn.c_attn.bias"), &[3 * h]);
                add(format!("{p}attn.c_proj.weight"), &[h, h]);
                add(format!("{p}attn.c_proj.bias"), &[h]);
                add(format!("{p}ln_2.weight"), &[h]);
                add(format!("{p}ln_2.bias"), &[h]);
                add(format!("{p}mlp.c_fc.weight"), &[h, ff]);
                add(format!("{p}mlp.c_fc.bias"), &[ff]);
                add(format!("{p}mlp.c_proj.weight"), &[ff, h]);
                add(format!("{p}mlp.c_proj.bias"), &[h]);
            }
            add("transformer.ln_f.weight".into(), &[h]);
            add("transformer.ln_f.bias".into(), &[h]);
        }
    }
    if !s.share_embeddings_and_output_weights {
        add("lm_head.weight".into(), &[v, h]);
    }
    out
}

/// A run of consecutive rows of the destination taken from one source. With `transposed`, the
/// rows are columns `first..first+len` of the source (a Conv1D weight stored `[in, out]`).
struct Rows {
    src: Option<String>,
    first: u64,
    len: u64,
    transposed: bool,
}

fn rows(src: &str, first: u64, len: u64) -> Rows {
    Rows { src: Some(src.into()), first, len, transposed: false }
}

/// Stacks runs of rows (each `cols` wide) and keeps destination rows `take`.
fn stack(runs: &[Rows], cols: u64, take: std::ops::Range<u64>) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut at = 0;
    for r in runs {
        let lo = at.max(take.start);
        let hi = (at + r.len).min(take.end);
        if lo < hi {
            let off = r.first + (lo - at);
            let (src_row, src_col) = if r.transposed { (0, off) } else { (off, 0) };
            out.push(Piece {
                src: r.src.clone(),
                src_row,
                src_col,
                dst_row: lo - take.start,
                dst_col: 0,
                rows: hi - lo,
                cols,
                transpose: r.transposed,
            });
        }
        at += r.len;
    }
    out
}

/// Columns `first..first+len` of `src` (rows `0..rows`), optionally read from its transpose.
fn cols(src: &str, rows: u64, first: u64, len: u64, transposed: bool) -> Vec<Piece> {
    let (src_row, src_col) = if transposed { (first, 0) } else { (0, first) };
    vec![Piece { src: Some(src.into()), src_row, src_col, dst_row: 0, dst_col: 0, rows, cols: len, transpose: transposed }]
}

fn whole(src: &str, n: u64) -> Vec<Piece> {
    stack(&[rows(src, 0, n)], 1, 0..n)
}

/// The Megatron-Core local-spec tensors of every (tp, pp) rank, in state_dict order.
pub fn shard_plan(s: &ModelShape, tp: u32, pp: u32) -> Vec<RankPlan> {
    let mut plans = Vec::new();
    let per_stage = s.num_layers / pp as u64;
    for p in 0..pp {
        for t in 0..tp {
            let mut tensors = Vec::new();
            let mut add = |name: String, shape: Vec<u64>, pieces: Vec<Piece>| tensors.push(TensorPlan { name, shape, pieces });
            let first = p == 0;
            let last = p == pp - 1;
            if first {
                let (n, sh) = embedding(s, tp, t);
                add("embedding.word_embeddings.weight".into(), sh, n);
                if s.architecture == Architecture::Gpt2 {
                    let (pos, h) = (s.max_position_embeddings, s.hidden_size);
                    add("embedding.position_embeddings.weight".into(), vec![pos, h], stack(&[rows("transformer.wpe.weight", 0, pos)], h, 0..pos));
                }
            }
            for local in 0..per_stage {
                let global = p as u64 * per_stage + local;
                for (name, shape, pieces) in layer(s, tp as u64, t as u64, global) {
                    add(format!("decoder.layers.{local}.{name}"), shape, pieces);
                }
            }
            if last {
                let h = s.hidden_size;
                let norm = if s.architecture == Architecture::Gpt2 { "transformer.ln_f" } else { "model.norm" };
                add("decoder.final_layernorm.weight".into(), vec![h], whole(&format!("{norm}.weight"), h));
                if s.architecture == Architecture::Gpt2 {
                    add("decoder.final_layernorm.bias".into(), vec![h], whole(&format!("{norm}.bias"), h));
                }
                // Untied models own an output layer. Tied models with pp > 1 also hold one on the
                // last stage: Megatron allocates it there and fills it from the first stage's
                // embedding, so it is part of that stage's state_dict.
                if !s.share_embeddings_and_output_weights || pp > 1 {
                    let src = if s.share_embeddings_and_output_weights { embed_name(s) } else { "lm_head.weight" };
                    let (n, sh) = vocab_rows(s, tp, t, src);
                    add("output_layer.weight".into(), sh, n);
                }
            }
            plans.push(RankPlan { tp: t, pp: p, tensors });
        }
    }
    plans
}

fn embed_name(s: &ModelShape) -> &'static str {
    if s.architecture == Architecture::Gpt2 {
        "transformer.wte.weight"
    } else {
        "model.embed_tokens.weight"
    }
}

fn embedding(s: &ModelShape, tp: u32, t: u32) -> (Vec<Piece>, Vec<u64>) {
    vocab_rows(s, tp, t, embed_name(s))
}

/// Rank `t`'s rows of a vocab-sized matrix padded with zero rows to Megatron's padded vocab.
fn vocab_rows(s: &ModelShape, tp: u32, t: u32, src: &str) -> (Vec<Piece>, Vec<u64>) {
    let padded = s.padded_vocab(tp);
    let per = padded / tp as u64;
    let runs = [rows(src, 0, s.vocab_size), Rows { src: None, first: 0, len: padded - s.vocab_size, transposed: false }];
    let take = t as u64 * per..(t as u64 + 1) * per;
    (stack(&runs, s.hidden_size, take), vec![per, s.hidden_size])
}

/// Splits an even range into `tp` parts and returns part `t`.
fn part(total: u64, tp: u64, t: u64) -> std::ops::Range<u64> {
    let n = total / tp;
    t * n..(t + 1) * n
}

fn layer(s: &ModelShape, tp: u64, t: u64, i: u64) -> Vec<(String, Vec<u64>, Vec<Piece>)> {
    let h = s.hidden_size;
    let hd = s.kv_channels;
    let ff = s.ffn_hidden_size;
    let q = s.num_attention_heads * hd;
    let mut out = Vec::new();
    let qkv_rows = s.qkv_rows();
    let take = part(qkv_rows, tp, t);
    match s.architecture {
        Architecture::Llama | Architecture::Qwen2 => {
            let p = format!("model.layers.{i}.");
            let a = format!("{p}self_attn.");
            // Per KV group g: [q heads of g; k_g; v_g] (Megatron's fused QKV layout).
            let qkv_runs = |suffix: &str| -> Vec<Rows> {
                let r = s.heads_per_group();
                let mut runs = Vec::new();
                for g in 0..s.num_query_groups {
                    runs.push(rows(&format!("{a}q_proj.{suffix}"), g * r * hd, r * hd));
                    runs.push(rows(&format!("{a}k_proj.{suffix}"), g * hd, hd));
                    runs.push(rows(&format!("{a}v_proj.{suffix}"), g * hd, hd));
                }
                runs
            };
            out.push(("input_layernorm.weight".into(), vec![h], whole(&format!("{p}input_layernorm.weight"), h)));
            out.push(("self_attention.linear_qkv.weight".into(), vec![qkv_rows / tp, h], stack(&qkv_runs("weight"), h, take.clone())));
            if s.add_qkv_bias {
                out.push(("self_attention.linear_qkv.bias".into(), vec![qkv_rows / tp], stack(&qkv_runs("bias"), 1, take)));
            }
            let qc = part(q, tp, t);
            out.push(("self_attention.linear_proj.weight".into(), vec![h, q / tp], cols(&format!("{a}o_proj.weight"), h, qc.start, q / tp, false)));
            out.push(("pre_mlp_layernorm.weight".into(), vec![h], whole(&format!("{p}post_attention_layernorm.weight"), h)));
            // fc1 on rank t is [gate_t; up_t], not a chunk of [gate; up].
            let fr = part(ff, tp, t);
            let fc1 = [rows(&format!("{p}mlp.gate_proj.weight"), fr.start, ff / tp), rows(&format!("{p}mlp.up_proj.weight"), fr.start, ff / tp)];
            out.push(("mlp.linear_fc1.weight".into(), vec![2 * ff / tp, h], stack(&fc1, h, 0..2 * ff / tp)));
            out.push(("mlp.linear_fc2.weight".into(), vec![h, ff / tp], cols(&format!("{p}mlp.down_proj.weight"), h, fr.start, ff / tp, false)));
        }
        Architecture::Gpt2 => {
            let p = format!("transformer.h.{i}.");
            // Conv1D stores [in, out]; Megatron wants [out, in], per head [q_h; k_h; v_h].
            let qkv_runs = |suffix: &str, transposed: bool| -> Vec<Rows> {
                let src = format!("{p}attn.c_attn.{suffix}");
                let mut runs = Vec::new();
                for head in 0..s.num_attention_heads {
                    for block in 0..3 {
                        runs.push(Rows { src: Some(src.clone()), first: block * h + head * hd, len: hd, transposed });
                    }
                }
                runs
            };
            let fr = part(ff, tp, t);
            let norm = |dst: &str, src: &str| {
                [
                    (format!("{dst}.weight"), vec![h], whole(&format!("{p}{src}.weight"), h)),
                    (format!("{dst}.bias"), vec![h], whole(&format!("{p}{src}.bias"), h)),
                ]
            };
            out.extend(norm("input_layernorm", "ln_1"));
            out.push(("self_attention.linear_qkv.weight".into(), vec![qkv_rows / tp, h], stack(&qkv_runs("weight", true), h, take.clone())));
            out.push(("self_attention.linear_qkv.bias".into(), vec![qkv_rows / tp], stack(&qkv_runs("bias", false), 1, take)));
            let qc = part(q, tp, t);
            out.push(("self_attention.linear_proj.weight".into(), vec![h, q / tp], cols(&format!("{p}attn.c_proj.weight"), h, qc.start, q / tp, true)));
            out.push(("self_attention.linear_proj.bias".into(), vec![h], whole(&format!("{p}attn.c_proj.bias"), h)));
            out.extend(norm("pre_mlp_layernorm", "ln_2"));
            let fc_runs = [Rows { src: Some(format!("{p}mlp.c_fc.weight")), first: fr.start, len: ff / tp, transposed: true }];
            out.push(("mlp.linear_fc1.weight".into(), vec![ff / tp, h], stack(&fc_runs, h, 0..ff / tp)));
            out.push(("mlp.linear_fc1.bias".into(), vec![ff / tp], stack(&[rows(&format!("{p}mlp.c_fc.bias"), fr.start, ff / tp)], 1, 0..ff / tp)));
            out.push(("mlp.linear_fc2.weight".into(), vec![h, ff / tp], cols(&format!("{p}mlp.c_proj.weight"), h, fr.start, ff / tp, true)));
            out.push(("mlp.linear_fc2.bias".into(), vec![h], whole(&format!("{p}mlp.c_proj.bias"), h)));
        }
    }
    out
}

/// Source key of a rank tensor, used when rank tensors are the sources (export, reshard).
pub fn rank_key(tp: u32, pp: u32, name: &str) -> String {
    format!("{tp}/{pp}/{name}")
}

/// Turns a shard plan around: for every Hugging Face tensor, the pieces of rank tensors (keyed
/// by [`rank_key`]) that hold it. Replicated copies are read once. Returns an error message if
/// some element is not covered, which would be a bug in [`shard_plan`].
pub fn invert(plans: &[RankPlan], hf: &[(String, Vec<u64>)]) -> Result<BTreeMap<String, Vec<Piece>>, String> {
    let mut by_src: BTreeMap<&str, Vec<Piece>> = BTreeMap::new();
    for rank in plans {
        for t in &rank.tensors {
            let key = rank_key(rank.tp, rank.pp, &t.name);
            for p in &t.pieces {
                let Some(src) = &p.src else { continue };
                let (rows, cols) = if p.transpose { (p.cols, p.rows) } else { (p.rows, p.cols) };
                let inv = Piece {
                    src: Some(key.clone()),
                    src_row: p.dst_row,
                    src_col: p.dst_col,
                    dst_row: p.src_row,
                    dst_col: p.src_col,
                    rows,
                    cols,
                    transpose: p.transpose,
                };
                let kept = by_src.entry(src.as_str()).or_default();
                let same_rect = |k: &Piece| k.dst_row == inv.dst_row && k.dst_col == inv.dst_col && k.rows == inv.rows && k.cols == inv.cols;
                if !kept.iter().any(same_rect) {
                    kept.push(inv);
                }
            }
        }
    }
    let mut out = BTreeMap::new();
    for (name, shape) in hf {
        let pieces = by_src.remove(name.as_str()).unwrap_or_default();
        let (r, c) = matrix(shape);
        let area: u64 = pieces.iter().map(|p| p.rows * p.cols).sum();
        if area != r * c {
            return Err(format!("tensor {name}: plan covers {area} of {} elements", r * c));
        }
        out.insert(name.clone(), pieces);
    }
    Ok(out)
}

/// Rewrites a piece that reads a logical tensor into pieces that read that tensor's own sources.
pub fn compose(p: &Piece, logical: &BTreeMap<String, Vec<Piece>>) -> Vec<Piece> {
    let Some(src) = &p.src else { return vec![p.clone()] };
    let Some(defs) = logical.get(src) else { return Vec::new() };
    // The region of the logical tensor that `p` reads, in logical coordinates.
    let (lr, lc) = if p.transpose { (p.cols, p.rows) } else { (p.rows, p.cols) };
    let mut out = Vec::new();
    for q in defs {
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
