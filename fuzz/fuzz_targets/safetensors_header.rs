//! Feeds arbitrary bytes to the untrusted safetensors reader of mflow-ckpt. It must return an
//! error or a header whose tensors lie inside the buffer, and never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

// The reader module is compiled on its own so that the fuzz build does not instrument the
// rest of mflow-ckpt (tokenizers, HTTP client).
#[path = "../../crates/mflow-ckpt/src/st.rs"]
#[allow(dead_code)]
mod st;
#[path = "../../crates/mflow-ckpt/src/untrusted.rs"]
#[allow(dead_code)]
mod untrusted;

fuzz_target!(|data: &[u8]| {
    if let Ok(header) = st::parse("fuzz-input", data) {
        for meta in header.tensors.values() {
            assert!(meta.start <= meta.end && meta.end <= data.len());
        }
    }
});
