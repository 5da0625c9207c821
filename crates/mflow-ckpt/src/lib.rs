//! Checkpoints for mflow: Hugging Face <-> Megatron-Core conversion, resharding, export,
//! random-init presets and Hugging Face Hub downloads.
//!
//! The shards format is documented in docs/formats.md ("Megatron shards").

pub mod cli;
pub mod convert;
pub mod error;
pub mod hf;
pub mod hub;
mod inverse;
pub mod layout;
pub mod memory;
pub mod presets;
mod replicas;
pub mod shape;
pub mod shards;
pub mod st;
mod tokenizer;
pub mod untrusted;
pub mod writer;

use std::path::Path;

pub use error::CkptError;
pub use hub::{is_unavailable as hub_unavailable, resolve_hf_revision};
pub use shape::{check_parallelism, Architecture, ModelShape};

/// Names accepted by `init:PRESET`.
pub fn preset_names() -> &'static [&'static str] {
    presets::NAMES
}

/// The shape of a preset, for plan-time checks.
pub fn preset_shape(name: &str) -> Option<ModelShape> {
    presets::shape(name)
}

/// The shape of the model in a Hugging Face directory or an mflow shards directory.
pub fn read_shape(dir: &Path) -> Result<ModelShape, CkptError> {
    if dir.join(shards::MANIFEST).exists() {
        Ok(shards::read_manifest(dir)?.model.shape)
    } else if dir.join("config.json").exists() {
        Ok(hf::read_config(dir)?.1)
    } else {
        Err(CkptError::UnknownDir { dir: dir.display().to_string() })
    }
}

#[cfg(test)]
#[global_allocator]
static COUNTING: mflow_untrusted::counting::Counting = mflow_untrusted::counting::Counting;
