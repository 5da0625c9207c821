//! Feeds arbitrary bytes, as tokenizer.json, to mflow-data's estimate of what loading it would
//! hold. It must take exactly the documents serde_json takes, never panic, and never estimate
//! less than the text itself; a document the `tokenizers` crate loads is one it estimated.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let need = mflow_data::tokenize::load_need(data);
    assert_eq!(need.is_ok(), serde_json::from_slice::<serde::de::IgnoredAny>(data).is_ok());
    let Ok(need) = need else {
        assert!(tokenizers::Tokenizer::from_bytes(data).is_err());
        return;
    };
    assert!(need.total() >= data.len() as u64);
    // Loading is tried only where the estimate is small: what it says is what stops the rest.
    if need.total() < 64 << 20 {
        let _ = tokenizers::Tokenizer::from_bytes(data);
    }
});
