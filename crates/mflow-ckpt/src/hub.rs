//! Hugging Face Hub downloads.
use crate::error::CkptError;

pub fn resolve_hf_revision(source: &str) -> Result<String, CkptError> {
    Err(CkptError::Source { source_spec: source.into(), presets: String::new() })
}

pub fn download(source: &str, _dst: &std::path::Path) -> Result<(), CkptError> {
    Err(CkptError::Source { source_spec: source.into(), presets: String::new() })
}
