//! Feeds arbitrary bytes, as config.json, to mflow-ckpt's Hugging Face config reader. It must
//! return an error or a shape within mflow's bounds, and never panic. For a shape it accepts,
//! what converting it would hold is computed without overflow, and where the plan is small
//! enough to make, its size is the size `plan_size` gives without making it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mflow_ckpt::layout::{plan_size, shard_plan};
use mflow_ckpt::memory::{convert_need, export_need, reshard_need};
use mflow_ckpt::shape::{from_hf_config, ModelShape, MAX_LAYERS};

/// Small layouts that split `shape` evenly.
fn layouts(shape: &ModelShape) -> Vec<(u32, u32)> {
    let fits = |tp: u32, pp: u32| mflow_ckpt::check_parallelism(shape, tp, pp).is_ok();
    [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (3, 1)].into_iter().filter(|&(t, p)| fits(t, p)).collect()
}

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    match from_hf_config("config.json", &value) {
        Ok(shape) => {
            assert!(shape.validate("config.json").is_ok());
            assert!((1..=MAX_LAYERS).contains(&shape.num_layers));
            for (tp, pp) in layouts(&shape) {
                let size = plan_size(&shape, tp, pp);
                assert!(convert_need(&shape, tp, pp).total() >= size.pieces);
                let _ = (export_need(&shape, tp, pp).total(), reshard_need(&shape, (tp, pp), (1, 1)).total());
                if size.pieces > 20_000 || size.tensors > 20_000 {
                    continue;
                }
                let plan = shard_plan(&shape, tp, pp);
                let tensors: u64 = plan.iter().map(|r| r.tensors.len() as u64).sum();
                let pieces: u64 = plan.iter().flat_map(|r| &r.tensors).map(|t| t.pieces.len() as u64).sum();
                let slots: u64 = plan.iter().flat_map(|r| &r.tensors).map(|t| t.pieces.capacity() as u64).sum();
                assert_eq!((size.ranks, size.tensors), (plan.len() as u64, tensors), "{shape:?} {tp}x{pp}");
                assert_eq!(size.rank_tensors, plan.iter().map(|r| r.tensors.len() as u64).max().unwrap());
                assert_eq!((size.pieces, size.slots), (pieces, slots), "{shape:?} {tp}x{pp}");
            }
        }
        // Messages quote only excerpts of the input.
        Err(e) => assert!(e.to_string().len() < 2048, "{} bytes", e.to_string().len()),
    }
});
