//! Feeds arbitrary bytes, as config.json, to mflow-ckpt's Hugging Face config reader. It must
//! return an error or a shape within mflow's bounds, and never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mflow_ckpt::shape::{from_hf_config, MAX_LAYERS};

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    match from_hf_config("config.json", &value) {
        Ok(shape) => {
            assert!(shape.validate("config.json").is_ok());
            assert!((1..=MAX_LAYERS).contains(&shape.num_layers));
        }
        // Messages quote only excerpts of the input.
        Err(e) => assert!(e.to_string().len() < 2048, "{} bytes", e.to_string().len()),
    }
});
