//! What reading and converting a checkpoint will hold in memory, computed from the sizes that
//! config.json, mflow-checkpoint.json and the safetensors headers declare, before any of it is
//! allocated, and refused past the process's memory budget (`mflow_untrusted::budget`:
//! `MFLOW_MEMORY_BUDGET`, else half of the memory this process may use).
//!
//! Every size is bounded on its own (shape.rs), but a plan holds their products: a piece per
//! q, k and v block of every KV group of every layer, a name per tensor, a vector of pieces per
//! tensor of every rank. 4096 layers of 16384 KV groups of one row each describe a 1 GB
//! model, and a plan of 28 GB. The figures below are upper bounds built from the sizes of the
//! structures that hold them; the tests compare them with what planning really allocates.

use std::io::Read;
use std::mem::size_of;
use std::path::Path;

use mflow_untrusted::budget::{Budget, Need};

use crate::error::CkptError;
use crate::layout::{hf_tensor_count, plan_size, Piece, PlanSize, RankPlan, TensorPlan};
use crate::shape::ModelShape;
use crate::st::{MAX_HEADER_BYTES, MAX_TENSORS};
use crate::untrusted::{open_regular, resolve_inside};

/// An allocated tensor name (mflow's are under 60 bytes).
const NAME: u64 = 64;
/// The key of a rank tensor as a source (`tp/pp/name`).
const RANK_KEY: u64 = 80;
/// A slot of a vector of pieces.
const SLOT: u64 = size_of::<Piece>() as u64;
/// A planned tensor: its slot in its rank's vector and that vector's spare capacity (at most as
/// much again), its name and its shape.
const TENSOR: u64 = 2 * size_of::<TensorPlan>() as u64 + NAME + 16;
/// A piece of the inverse plan: slot and spare, the rank key it reads, its rectangle in the set
/// that finds replicated copies.
const INVERSE_PIECE: u64 = 2 * SLOT + RANK_KEY + 48;
/// A tensor of the sources' index (two names and a hash-table entry).
const SOURCE: u64 = RANK_KEY + NAME + 96;
/// A Hugging Face tensor in the list of expected ones and the map that looks them up.
const HF_TENSOR: u64 = 2 * 48 + NAME + 16 + 64;
/// A tensor's entry in the header of a file being written, while the header is built.
const HEADER_ENTRY: u64 = 512;
/// A writer's buffer of zeros and its smallest read buffer (writer.rs steps a MiB at a time).
const STEP: u64 = 1 << 20;
/// Parsing a safetensors header holds about this much per tensor (both readings of it:
/// mflow's and the safetensors crate's), besides twice its names (measured: 970 bytes for
/// 65,536 tensors of one-byte names).
const HEADER_TENSOR: u64 = 1024;
/// The shortest JSON entry of a tensor in a header (`"a":{"dtype":"F32","shape":[],"data_offsets":[0,0]},`).
const HEADER_ENTRY_TEXT: u64 = 48;

/// The budget of this process.
pub fn budget() -> Result<Budget, CkptError> {
    Ok(Budget::from_env()?)
}

/// Refuses `need` past the budget, naming `file`, the file whose sizes it comes from.
pub fn check(file: &Path, what: impl Into<String>, need: Need) -> Result<(), CkptError> {
    budget()?
        .check(what, need)
        .map_err(|over| CkptError::OverBudget { file: file.display().to_string(), over: Box::new(over) })
}

/// The most that parsing a safetensors header of `len` bytes holds: as many tensors as the
/// shortest entries make of it (at most [`MAX_TENSORS`]), and its names twice.
pub fn header(len: u64) -> u64 {
    let len = len.min(MAX_HEADER_BYTES);
    let tensors = (len / HEADER_ENTRY_TEXT + 1).min(MAX_TENSORS as u64);
    tensors * HEADER_TENSOR + 2 * len
}

/// Reads the header length of each file (its first 8 bytes, within the file and the header
/// limit) and refuses past the budget what parsing all of them will hold: every header stays
/// in memory while the files are open. Each file must resolve inside `dir`. `label` names the
/// file that listed them.
pub fn check_headers(dir: &Path, files: &[String], label: &Path) -> Result<(), CkptError> {
    let mut total = 0u64;
    for f in files {
        // A link out of the directory is refused first; a missing file is reported by the open.
        resolve_inside(dir, f)?;
        total = total.saturating_add(header(header_len(&dir.join(f))?));
    }
    let mut need = Need::new();
    need.add(format!("the headers of {} safetensors files", files.len()), total);
    check(label, format!("reading {}", label.display()), need)
}

/// The header length a safetensors file declares, cut to what the file holds; 0 for a file too
/// short to declare one (opening it says what is wrong).
fn header_len(path: &Path) -> Result<u64, CkptError> {
    let mut f = open_regular(path)?;
    let size = f.metadata().map_err(crate::error::io(path))?.len();
    let mut first = [0u8; 8];
    if size < 8 || f.read_exact(&mut first).is_err() {
        return Ok(0);
    }
    Ok(u64::from_le_bytes(first).min(size - 8))
}

/// What a plan of this size holds: its ranks, tensors, the slots of their pieces, and the name
/// of each piece's source.
pub fn plan_bytes(p: &PlanSize) -> u64 {
    let ranks = p.ranks.saturating_mul(2 * size_of::<RankPlan>() as u64);
    ranks
        .saturating_add(p.tensors.saturating_mul(TENSOR))
        .saturating_add(p.slots.saturating_mul(SLOT))
        .saturating_add(p.pieces.saturating_mul(NAME))
}

/// The sizes that multiplied, for the message: layers, heads, groups.
fn model_words(s: &ModelShape) -> String {
    format!(
        "{} layers, {} attention heads in {} KV groups of {} channels, vocabulary {}",
        s.num_layers, s.num_attention_heads, s.num_query_groups, s.kv_channels, s.vocab_size
    )
}

fn plan_part(need: &mut Need, what: &str, p: &PlanSize) {
    need.add(format!("{what} ({} pieces of {} tensors in {} rank files)", p.pieces, p.tensors, p.ranks), plan_bytes(p));
}

/// The buffers of the threads that write files of at most `tensors` tensors each: a step of
/// zeros, a read buffer as wide as the widest row (a MiB at least), the header being built.
fn writers(need: &mut Need, s: &ModelShape, tensors: u64) {
    let threads = rayon::current_num_threads() as u64;
    let widest = [3 * s.hidden_size, s.ffn_hidden_size, s.num_attention_heads * s.kv_channels]
        .into_iter()
        .max()
        .unwrap_or(0)
        .saturating_mul(4);
    let each = STEP + widest.max(STEP) + tensors.saturating_mul(HEADER_ENTRY);
    need.add(format!("the buffers of {threads} writing threads"), threads.saturating_mul(each));
}

/// Hugging Face weights -> shards at `tp` x `pp`: the plan, the index of the source tensors,
/// the writers.
pub fn convert_need(s: &ModelShape, tp: u32, pp: u32) -> Need {
    let mut need = Need::new();
    let p = plan_size(s, tp, pp);
    plan_part(&mut need, "the plan", &p);
    let hf = hf_tensor_count(s);
    need.add(format!("the index of {hf} source tensors"), hf.saturating_mul(SOURCE + HF_TENSOR));
    writers(&mut need, s, p.rank_tensors);
    need
}

/// Shards at `from` -> shards at `to`: the inverse of the first plan, and the first plan or
/// the second with its composition, whichever is more; the sources, the writers.
pub fn reshard_need(s: &ModelShape, from: (u32, u32), to: (u32, u32)) -> Need {
    let mut need = Need::new();
    let old = plan_size(s, from.0, from.1);
    let new = plan_size(s, to.0, to.1);
    inverse_part(&mut need, s, &old);
    // The plan of the source is dropped once inverted; then the new plan is made and each of
    // its tensors' pieces replaced by the composed ones: at most a piece more per piece of the
    // inverse that a cut falls in, each reading a rank key.
    let pieces = new.pieces.saturating_add(old.pieces);
    let composed = pieces.saturating_mul(2 * SLOT + RANK_KEY);
    if plan_bytes(&old) > plan_bytes(&new).saturating_add(composed) {
        plan_part(&mut need, "the plan of the source shards", &old);
    } else {
        plan_part(&mut need, "the new plan", &new);
        need.add(format!("the new plan composed with the inverse (at most {pieces} pieces)"), composed);
    }
    need.add(format!("the index of {} source tensors", old.tensors), old.tensors.saturating_mul(SOURCE));
    writers(&mut need, s, new.rank_tensors);
    need
}

/// Shards at `tp` x `pp` -> Hugging Face weights: the plan, its inverse (which becomes the
/// plan of the files written), the sources, the writers.
pub fn export_need(s: &ModelShape, tp: u32, pp: u32) -> Need {
    let mut need = Need::new();
    let p = plan_size(s, tp, pp);
    plan_part(&mut need, "the plan of the shards", &p);
    inverse_part(&mut need, s, &p);
    need.add(format!("the index of {} source tensors", p.tensors), p.tensors.saturating_mul(SOURCE));
    writers(&mut need, s, hf_tensor_count(s));
    need
}

fn inverse_part(need: &mut Need, s: &ModelShape, p: &PlanSize) {
    let hf = hf_tensor_count(s);
    let bytes = p.pieces.saturating_mul(INVERSE_PIECE).saturating_add(hf.saturating_mul(HF_TENSOR + TENSOR));
    need.add(format!("its inverse ({hf} Hugging Face tensors)"), bytes);
}

/// What an operation is, for the message: `doing` and the sizes of the model it does it to.
pub fn what(doing: &str, s: &ModelShape) -> String {
    format!("{doing} ({})", model_words(s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{hf_tensors, invert, shard_plan, Inverse};
    use crate::presets;
    use crate::writer::non_empty;

    /// Real presets and small shapes that multiply like hostile ones (many groups, many heads).
    fn shapes() -> Vec<ModelShape> {
        let mut v: Vec<ModelShape> = presets::NAMES.iter().map(|n| presets::shape(n).unwrap()).collect();
        let llama = presets::shape("llama-tiny").unwrap();
        v.push(ModelShape {
            num_layers: 8,
            hidden_size: 1,
            num_attention_heads: 512,
            num_query_groups: 512,
            kv_channels: 1,
            ffn_hidden_size: 4,
            vocab_size: 3,
            ..llama.clone()
        });
        v.push(ModelShape { num_query_groups: 64, add_qkv_bias: true, ..v.last().unwrap().clone() });
        v.push(ModelShape {
            num_layers: 6,
            num_attention_heads: 96,
            num_query_groups: 96,
            kv_channels: 2,
            hidden_size: 192,
            ..presets::shape("gpt2-tiny").unwrap()
        });
        v
    }

    #[test]
    fn plan_size_is_the_size_of_the_plan() {
        for s in shapes() {
            for (tp, pp) in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (8, 2)] {
                if crate::check_parallelism(&s, tp, pp).is_err() {
                    continue;
                }
                let plan = shard_plan(&s, tp, pp);
                let size = plan_size(&s, tp, pp);
                let tensors: u64 = plan.iter().map(|r| r.tensors.len() as u64).sum();
                let pieces: u64 = plan.iter().flat_map(|r| &r.tensors).map(|t| t.pieces.len() as u64).sum();
                let slots: u64 = plan.iter().flat_map(|r| &r.tensors).map(|t| t.pieces.capacity() as u64).sum();
                let widest = plan.iter().map(|r| r.tensors.len() as u64).max().unwrap();
                assert_eq!((size.ranks, size.tensors, size.rank_tensors), (plan.len() as u64, tensors, widest));
                // Exact for an even layout.
                assert_eq!((size.pieces, size.slots), (pieces, slots), "{s:?} {tp}x{pp}");
                assert_eq!(hf_tensor_count(&s), hf_tensors(&s).len() as u64);
            }
        }
    }

    /// The figures against what planning allocates, counted by this test binary's allocator.
    #[test]
    fn the_figures_bound_what_planning_allocates() {
        for s in shapes() {
            for (tp, pp) in [(1, 1), (2, 1), (2, 2), (8, 2)] {
                if crate::check_parallelism(&s, tp, pp).is_err() {
                    continue;
                }
                let size = plan_size(&s, tp, pp);
                let (plan, held) = mflow_untrusted::counting::held_by(|| shard_plan(&s, tp, pp));
                let estimate = plan_bytes(&size);
                assert!(
                    held <= estimate && estimate <= 3 * held,
                    "plan {tp}x{pp} {s:?}: held {held}, estimate {estimate}"
                );
                // The inverse and a reshard composed with it.
                let (logical, held_inverse) =
                    mflow_untrusted::counting::held_by(|| Inverse::new(invert(&plan, &hf_tensors(&s)).unwrap()));
                let mut inverse = Need::new();
                inverse_part(&mut inverse, &s, &size);
                assert!(held_inverse <= inverse.total(), "inverse {tp}x{pp}: held {held_inverse}, {inverse:?}");
                let (composed, held_composed) = mflow_untrusted::counting::held_by(|| {
                    let mut new = shard_plan(&s, 1, 1);
                    for t in new.iter_mut().flat_map(|r| &mut r.tensors) {
                        t.pieces =
                            non_empty(t.pieces.iter().flat_map(|p| crate::layout::compose(p, &logical)).collect());
                    }
                    new
                });
                drop(composed);
                let need = reshard_need(&s, (tp, pp), (1, 1));
                assert!(held + held_inverse + held_composed <= need.total(), "reshard {tp}x{pp}: {need:?}");
            }
        }
    }

    #[test]
    fn the_hostile_shape_of_the_issue_needs_tens_of_gigabytes() {
        // 4096 layers x 16384 heads of one channel: a 1 GB model.
        let s = ModelShape {
            num_layers: 4096,
            hidden_size: 1,
            num_attention_heads: 16384,
            num_query_groups: 16384,
            kv_channels: 1,
            ffn_hidden_size: 1,
            vocab_size: 1,
            ..presets::shape("llama-tiny").unwrap()
        };
        let need = convert_need(&s, 1, 1).total();
        assert!((20 << 30..40 << 30).contains(&need), "{}", mflow_untrusted::budget::bytes(need));
        // Llama-3.2-1B's shape needs a few MiB besides the writers' buffers.
        let small = presets::shape("llama-1b").unwrap();
        for need in [convert_need(&small, 2, 2), reshard_need(&small, (2, 2), (1, 1)), export_need(&small, 2, 2)] {
            let plan: u64 = need.parts().iter().filter(|(w, _)| !w.contains("writing")).map(|(_, b)| b).sum();
            assert!(plan < 8 << 20, "{need:?}");
        }
    }
}
