//! Feeds arbitrary bytes, as mflow-checkpoint.json, to mflow-ckpt's manifest checks. They must
//! return an error or a manifest whose counts agree, and never panic; what exporting or
//! resharding the manifest's shards would hold is computed without overflow.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mflow_ckpt::memory::{export_need, reshard_need};
use mflow_ckpt::shards::parse_manifest;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    match parse_manifest(std::path::Path::new("mflow-checkpoint.json"), value) {
        Ok(m) => {
            assert_eq!(m.files.len() as u64, m.tp as u64 * m.pp as u64);
            assert_eq!(m.layers_per_stage.iter().sum::<u64>(), m.model.shape.num_layers);
            let shape = &m.model.shape;
            let export = export_need(shape, m.tp, m.pp).total();
            let reshard = reshard_need(shape, (m.tp, m.pp), (1, 1)).total();
            assert!(export > 0 && reshard > 0);
        }
        Err(e) => assert!(e.to_string().len() < 2048, "{} bytes", e.to_string().len()),
    }
});
