//! Where every element of every tensor comes from.
//!
//! One mapping is written by hand: how each Megatron per-rank tensor is assembled from blocks of
//! Hugging Face tensors ([`shard_plan`]). Export inverts it ([`invert`]) and resharding composes
//! the new plan with the inverse of the old one ([`compose`]); both are in inverse.rs. A tensor is viewed as a matrix:
//! 2-D tensors as they are, 1-D tensors as one column.

pub use crate::inverse::{compose, invert, Inverse};
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

/// How many tensors [`hf_tensors`] lists, without listing them.
pub fn hf_tensor_count(s: &ModelShape) -> u64 {
    let (outside, per_layer) = match s.architecture {
        Architecture::Llama | Architecture::Qwen2 => (2, 9 + 3 * s.add_qkv_bias as u64),
        Architecture::Gpt2 => (4, 12),
    };
    outside + s.num_layers * per_layer + !s.share_embeddings_and_output_weights as u64
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
    stack_from(runs, 0, cols, take)
}

/// [`stack`] of runs whose first starts at destination row `start` (the runs before it lie
/// wholly before `take`, and are not made at all: a rank of a fused QKV reads its own groups
/// only, so that planning every rank costs the groups once, not once per rank).
fn stack_from(runs: &[Rows], start: u64, cols: u64, take: std::ops::Range<u64>) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut at = start;
    for r in runs {
        if at >= take.end {
            break;
        }
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
    vec![Piece {
        src: Some(src.into()),
        src_row,
        src_col,
        dst_row: 0,
        dst_col: 0,
        rows,
        cols: len,
        transpose: transposed,
    }]
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
            let mut add =
                |name: String, shape: Vec<u64>, pieces: Vec<Piece>| tensors.push(TensorPlan { name, shape, pieces });
            let first = p == 0;
            let last = p == pp - 1;
            if first {
                let (n, sh) = embedding(s, tp, t);
                add("embedding.word_embeddings.weight".into(), sh, n);
                if s.architecture == Architecture::Gpt2 {
                    let (pos, h) = (s.max_position_embeddings, s.hidden_size);
                    add(
                        "embedding.position_embeddings.weight".into(),
                        vec![pos, h],
                        stack(&[rows("transformer.wpe.weight", 0, pos)], h, 0..pos),
                    );
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

/// The size of [`shard_plan`]`(s, tp, pp)`, computed from the shape alone: what planning will
/// hold, known before any of it is allocated. For a layout that splits the model evenly
/// ([`crate::check_parallelism`]) the counts are exact; otherwise `pieces` and `slots` are upper
/// bounds. Tests compare them with the plans themselves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanSize {
    pub ranks: u64,
    pub tensors: u64,
    pub pieces: u64,
    /// The capacity of the tensors' vectors of pieces, in pieces.
    pub slots: u64,
    /// The most tensors in one rank file.
    pub rank_tensors: u64,
}

/// The capacity of a vector after `n` pushes.
fn pushed(n: u64) -> u64 {
    if n == 0 {
        0
    } else {
        n.checked_next_power_of_two().unwrap_or(u64::MAX).max(4)
    }
}

pub fn plan_size(s: &ModelShape, tp: u32, pp: u32) -> PlanSize {
    let (tp, pp) = (tp.max(1) as u64, pp.max(1) as u64);
    let layers = s.num_layers;
    let gpt2 = s.architecture == Architecture::Gpt2;
    // A fused QKV: a run per q, k and v block of each group (GPT-2: of each head); a rank of an
    // even split reads whole groups, otherwise a run may be cut in two at a rank boundary.
    let units = if gpt2 { s.num_attention_heads } else { s.num_query_groups };
    let even = units.is_multiple_of(tp);
    let (qkv_rank, qkv_all) =
        if even { (3 * units / tp, 3 * units) } else { ((3 * units).div_ceil(tp) + 1, 3 * units + tp) };
    let qkv_count = 1 + (gpt2 || s.add_qkv_bias) as u64;
    // The other tensors of a layer on a rank, their pieces and the capacity of their vectors
    // (pushed: at least 4; `cols` makes a vector of one).
    let (other_tensors, other_pieces, other_slots) = if gpt2 { (10, 10, 34) } else { (5, 6, 14) };
    let layer_tensors = other_tensors + qkv_count;
    // A vocabulary matrix: a piece per rank, and one more where the rank holding the last row
    // also holds padding.
    let per = s.padded_vocab(tp as u32) / tp;
    let vocab = tp + (per > 0 && !s.vocab_size.is_multiple_of(per)) as u64;
    let output = !s.share_embeddings_and_output_weights || pp > 1;
    // (tensors per rank, pieces over the stage's ranks, slots per rank) of the first and last
    // stage's own tensors: the embedding and GPT-2's positions; the final norm (and its bias)
    // and the output layer.
    let first = (1 + gpt2 as u64, vocab + gpt2 as u64 * tp, 4 + gpt2 as u64 * 4);
    let last = (
        1 + gpt2 as u64 + output as u64,
        (1 + gpt2 as u64) * tp + output as u64 * vocab,
        4 * (1 + gpt2 as u64 + output as u64),
    );
    let tensors = layers * tp * layer_tensors + tp * (first.0 + last.0);
    let pieces = layers * (tp * other_pieces + qkv_count * qkv_all) + first.1 + last.1;
    let slots = layers * tp * (other_slots + qkv_count * pushed(qkv_rank)) + tp * (first.2 + last.2);
    let per_stage = layers / pp;
    let rank_tensors = per_stage * layer_tensors + if pp == 1 { first.0 + last.0 } else { first.0.max(last.0) };
    PlanSize { ranks: tp * pp, tensors, pieces, slots, rank_tensors }
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
    let runs =
        [rows(src, 0, s.vocab_size), Rows { src: None, first: 0, len: padded - s.vocab_size, transposed: false }];
    let take = t as u64 * per..(t as u64 + 1) * per;
    (stack(&runs, s.hidden_size, take), vec![per, s.hidden_size])
}

/// Splits an even range into `tp` parts and returns part `t`.
fn part(total: u64, tp: u64, t: u64) -> std::ops::Range<u64> {
    let n = total / tp;
    t * n..(t + 1) * n
}

/// The runs of a Llama or Qwen2 fused QKV (`a`: the layer's `self_attn.` prefix) that rows
/// `take` reach, and the row the first of them starts at. Per KV group g: [q heads of g; k_g;
/// v_g] (Megatron's fused QKV layout); the groups before `take` are not made at all.
fn grouped_qkv(s: &ModelShape, a: &str, suffix: &str, take: &std::ops::Range<u64>) -> (Vec<Rows>, u64) {
    let (hd, r) = (s.kv_channels, s.heads_per_group());
    let group = (r + 2) * hd;
    let groups = take.start / group..take.end.div_ceil(group).min(s.num_query_groups);
    let (q, k, v) = (format!("{a}q_proj.{suffix}"), format!("{a}k_proj.{suffix}"), format!("{a}v_proj.{suffix}"));
    let mut runs = Vec::new();
    for g in groups.clone() {
        runs.push(rows(&q, g * r * hd, r * hd));
        runs.push(rows(&k, g * hd, hd));
        runs.push(rows(&v, g * hd, hd));
    }
    (runs, groups.start * group)
}

/// The runs of a GPT-2 fused QKV (`p`: the layer's prefix) that rows `take` reach, and the row
/// the first of them starts at. Conv1D stores [in, out]; Megatron wants [out, in], per head
/// [q_h; k_h; v_h].
fn per_head_qkv(
    s: &ModelShape,
    p: &str,
    suffix: &str,
    transposed: bool,
    take: &std::ops::Range<u64>,
) -> (Vec<Rows>, u64) {
    let (h, hd) = (s.hidden_size, s.kv_channels);
    let heads = take.start / (3 * hd)..take.end.div_ceil(3 * hd).min(s.num_attention_heads);
    let src = format!("{p}attn.c_attn.{suffix}");
    let mut runs = Vec::new();
    for head in heads.clone() {
        for block in 0..3 {
            runs.push(Rows { src: Some(src.clone()), first: block * h + head * hd, len: hd, transposed });
        }
    }
    (runs, heads.start * 3 * hd)
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
            let qkv_runs = |suffix: &str| grouped_qkv(s, &a, suffix, &take);
            out.push(("input_layernorm.weight".into(), vec![h], whole(&format!("{p}input_layernorm.weight"), h)));
            let (runs, start) = qkv_runs("weight");
            out.push((
                "self_attention.linear_qkv.weight".into(),
                vec![qkv_rows / tp, h],
                stack_from(&runs, start, h, take.clone()),
            ));
            if s.add_qkv_bias {
                let (runs, start) = qkv_runs("bias");
                out.push((
                    "self_attention.linear_qkv.bias".into(),
                    vec![qkv_rows / tp],
                    stack_from(&runs, start, 1, take),
                ));
            }
            let qc = part(q, tp, t);
            out.push((
                "self_attention.linear_proj.weight".into(),
                vec![h, q / tp],
                cols(&format!("{a}o_proj.weight"), h, qc.start, q / tp, false),
            ));
            out.push((
                "pre_mlp_layernorm.weight".into(),
                vec![h],
                whole(&format!("{p}post_attention_layernorm.weight"), h),
            ));
            // fc1 on rank t is [gate_t; up_t], not a chunk of [gate; up].
            let fr = part(ff, tp, t);
            let fc1 = [
                rows(&format!("{p}mlp.gate_proj.weight"), fr.start, ff / tp),
                rows(&format!("{p}mlp.up_proj.weight"), fr.start, ff / tp),
            ];
            out.push(("mlp.linear_fc1.weight".into(), vec![2 * ff / tp, h], stack(&fc1, h, 0..2 * ff / tp)));
            out.push((
                "mlp.linear_fc2.weight".into(),
                vec![h, ff / tp],
                cols(&format!("{p}mlp.down_proj.weight"), h, fr.start, ff / tp, false),
            ));
        }
        Architecture::Gpt2 => {
            let p = format!("transformer.h.{i}.");
            let qkv_runs = |suffix: &str, transposed: bool| per_head_qkv(s, &p, suffix, transposed, &take);
            let fr = part(ff, tp, t);
            let norm = |dst: &str, src: &str| {
                [
                    (format!("{dst}.weight"), vec![h], whole(&format!("{p}{src}.weight"), h)),
                    (format!("{dst}.bias"), vec![h], whole(&format!("{p}{src}.bias"), h)),
                ]
            };
            out.extend(norm("input_layernorm", "ln_1"));
            let (runs, start) = qkv_runs("weight", true);
            out.push((
                "self_attention.linear_qkv.weight".into(),
                vec![qkv_rows / tp, h],
                stack_from(&runs, start, h, take.clone()),
            ));
            let (runs, start) = qkv_runs("bias", false);
            out.push(("self_attention.linear_qkv.bias".into(), vec![qkv_rows / tp], stack_from(&runs, start, 1, take)));
            let qc = part(q, tp, t);
            out.push((
                "self_attention.linear_proj.weight".into(),
                vec![h, q / tp],
                cols(&format!("{p}attn.c_proj.weight"), h, qc.start, q / tp, true),
            ));
            out.push(("self_attention.linear_proj.bias".into(), vec![h], whole(&format!("{p}attn.c_proj.bias"), h)));
            out.extend(norm("pre_mlp_layernorm", "ln_2"));
            let fc_runs =
                [Rows { src: Some(format!("{p}mlp.c_fc.weight")), first: fr.start, len: ff / tp, transposed: true }];
            out.push(("mlp.linear_fc1.weight".into(), vec![ff / tp, h], stack(&fc_runs, h, 0..ff / tp)));
            out.push((
                "mlp.linear_fc1.bias".into(),
                vec![ff / tp],
                stack(&[rows(&format!("{p}mlp.c_fc.bias"), fr.start, ff / tp)], 1, 0..ff / tp),
            ));
            out.push((
                "mlp.linear_fc2.weight".into(),
                vec![h, ff / tp],
                cols(&format!("{p}mlp.c_proj.weight"), h, fr.start, ff / tp, true),
            ));
            out.push(("mlp.linear_fc2.bias".into(), vec![h], whole(&format!("{p}mlp.c_proj.bias"), h)));
        }
    }
    out
}

/// Source key of a rank tensor, used when rank tensors are the sources (export, reshard).
pub fn rank_key(tp: u32, pp: u32, name: &str) -> String {
    format!("{tp}/{pp}/{name}")
}
