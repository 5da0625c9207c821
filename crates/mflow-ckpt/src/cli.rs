//! The `mflow model`, `mflow convert` and `mflow export` commands.

use std::path::PathBuf;

use crate::error::CkptError;
use crate::{convert as conv, hf, presets};

#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// hf://ORG/NAME[@REV] | path:DIR | init:PRESET
    pub source: String,
    /// The directory to write the HF model into (created; must not exist).
    pub dst: PathBuf,
    /// Seed of the random weights of an init: preset.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Gets a model: downloads it, validates and copies a local one, or writes a random-init preset.
pub fn model(args: &ModelArgs) -> miette::Result<()> {
    Ok(model_impl(args)?)
}

fn model_impl(args: &ModelArgs) -> Result<(), CkptError> {
    let unknown = || CkptError::Source { source_spec: args.source.clone(), presets: presets::NAMES.join(", ") };
    if let Some(name) = args.source.strip_prefix("init:") {
        let p = presets::preset(name).ok_or_else(unknown)?;
        presets::write(&p, &args.dst, args.seed)
    } else if let Some(dir) = args.source.strip_prefix("path:") {
        hf::copy_model(std::path::Path::new(dir), &args.dst)
    } else if args.source.starts_with("hf://") {
        crate::hub::download(&args.source, &args.dst)
    } else {
        Err(unknown())
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct ConvertArgs {
    /// An HF model directory, or shards of another layout.
    pub src: PathBuf,
    /// The directory to write the shards into (created; must not exist).
    pub dst: PathBuf,
    /// Tensor-parallel size of the shards.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub tp: u32,
    /// Pipeline-parallel size of the shards.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub pp: u32,
    /// keep (default), float32, bfloat16, float16
    #[arg(long)]
    pub dtype: Option<String>,
}

/// Hugging Face directory -> shards, or shards -> shards (resharding), detected from `src`.
pub fn convert(args: &ConvertArgs) -> miette::Result<()> {
    let dtype = conv::parse_dtype(args.dtype.as_deref())?;
    Ok(conv::convert(&args.src, &args.dst, args.tp, args.pp, dtype)?)
}

#[derive(clap::Args, Debug, Clone)]
pub struct ExportArgs {
    /// Shards to export (any tp x pp).
    pub src: PathBuf,
    /// The HF model directory to write (created; must not exist).
    pub dst: PathBuf,
}

/// Shards -> Hugging Face directory.
pub fn export(args: &ExportArgs) -> miette::Result<()> {
    Ok(conv::export(&args.src, &args.dst)?)
}
