//! Feeds arbitrary bytes, as tokenizer_config.json, to mflow-data's end-of-document lookup. It
//! must return a token, nothing or a reason, and never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some(token)) = mflow_data::tokenize::eos_token_of_config(data) {
        assert!(token.len() < data.len());
    }
});
