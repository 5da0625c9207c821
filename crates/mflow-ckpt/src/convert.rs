//! Hugging Face -> shards, shards -> shards (resharding) and shards -> Hugging Face.

use std::collections::BTreeMap;
use std::path::Path;

use mflow_progress::Reporter;
use rayon::prelude::*;
use safetensors::Dtype;
use serde_json::Value;

use crate::error::{io, CkptError};
use crate::hf::{self, copy_tokenizer, dtype_name, INDEX};
use crate::layout::{compose, hf_tensors, invert, rank_file_name, shard_plan, Inverse, RankPlan, TensorPlan};
use crate::memory;
use crate::shape::check_parallelism;
use crate::shards::{self, FileEntry, Then, GENERATION_CONFIG, HF_CONFIG, MANIFEST, TOKENIZER_DIR};
use crate::untrusted::copy_inside;
use crate::writer::{non_empty, write_file, Sources, Staging};

/// Hugging Face shards are cut once they pass this size, as transformers does by default.
pub const HF_SHARD_BYTES: u64 = 5_000_000_000;

/// What `--dtype` asks for: `None` keeps the source dtype.
pub fn parse_dtype(arg: Option<&str>) -> Result<Option<Dtype>, CkptError> {
    match arg {
        None | Some("keep") => Ok(None),
        Some("float32") | Some("fp32") => Ok(Some(Dtype::F32)),
        Some("bfloat16") | Some("bf16") => Ok(Some(Dtype::BF16)),
        Some("float16") | Some("fp16") => Ok(Some(Dtype::F16)),
        Some(other) => Err(CkptError::DtypeArg { value: other.into() }),
    }
}

/// Converts `src` (a Hugging Face directory or a shards directory) into shards at `dst`.
pub fn convert(src: &Path, dst: &Path, tp: u32, pp: u32, dtype: Option<Dtype>) -> Result<(), CkptError> {
    hf::check_source_dir(src)?;
    if src.join(MANIFEST).exists() {
        let mut old = shards::open(src, Then::Reshard { tp, pp })?;
        let shape = old.manifest.model.shape.clone();
        let old_plan = std::mem::take(&mut old.plan);
        let logical = Inverse::new(invert(&old_plan, &hf_tensors(&shape)).expect("shard plans cover every tensor"));
        drop(old_plan);
        let mut plan = shard_plan(&shape, tp, pp);
        for rank in &mut plan {
            for t in &mut rank.tensors {
                t.pieces = non_empty(t.pieces.iter().flat_map(|p| compose(p, &logical)).collect());
            }
        }
        let config = shards::hf_config(src)?;
        let out_dtype = dtype.unwrap_or(old.dtype);
        write_shards(dst, &shape, &plan, out_dtype, &old.sources, &config, (src, Some(TOKENIZER_DIR)), src)
    } else if src.join("config.json").exists() {
        let model = hf::open(src)?;
        check_parallelism(&model.shape, tp, pp)?;
        let doing = memory::what(&format!("converting to tp = {tp}, pp = {pp}"), &model.shape);
        memory::check(&src.join("config.json"), doing, memory::convert_need(&model.shape, tp, pp))?;
        let plan = shard_plan(&model.shape, tp, pp);
        let out_dtype = dtype.unwrap_or(model.dtype);
        write_shards(dst, &model.shape, &plan, out_dtype, &model.sources, &model.config, (src, None), src)
    } else {
        Err(CkptError::UnknownDir { dir: src.display().to_string() })
    }
}

#[allow(clippy::too_many_arguments)]
fn write_shards(
    dst: &Path,
    shape: &crate::shape::ModelShape,
    plan: &[RankPlan],
    dtype: Dtype,
    sources: &Sources,
    hf_config: &Value,
    tokenizer_from: (&Path, Option<&str>),
    // The directory holding generation_config.json, if it has one.
    generation_config: &Path,
) -> Result<(), CkptError> {
    let staging = Staging::new(dst)?;
    let total: u64 =
        plan.iter().flat_map(|r| &r.tensors).map(|t| t.shape.iter().product::<u64>() * dtype.size() as u64).sum();
    let progress = Reporter::new("convert", Some(total), "bytes");
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let files: Vec<FileEntry> = plan
        .par_iter()
        .map(|rank| {
            let name = rank_file_name(rank.tp, rank.pp);
            let (bytes, blake3) =
                write_file(&staging.dir().join(&name), &rank.tensors, dtype, &meta, sources, &progress)?;
            Ok(FileEntry { tp: rank.tp, pp: rank.pp, path: name, bytes, blake3 })
        })
        .collect::<Result<_, CkptError>>()?;
    let tok = staging.dir().join(TOKENIZER_DIR);
    std::fs::create_dir(&tok).map_err(io(&tok))?;
    copy_tokenizer(tokenizer_from.0, tokenizer_from.1, &tok)?;
    write_json(&staging.dir().join(HF_CONFIG), hf_config)?;
    copy_inside(generation_config, GENERATION_CONFIG, &staging.dir().join(GENERATION_CONFIG))?;
    let tp = plan.iter().map(|r| r.tp).max().unwrap_or(0) + 1;
    let pp = plan.iter().map(|r| r.pp).max().unwrap_or(0) + 1;
    let manifest = shards::manifest(shape, tp, pp, dtype, files);
    write_json(&staging.dir().join(MANIFEST), &serde_json::to_value(&manifest).expect("manifest serializes"))?;
    progress.finish();
    staging.commit()
}

/// Exports a shards directory back to a Hugging Face model directory.
pub fn export(src: &Path, dst: &Path) -> Result<(), CkptError> {
    hf::check_source_dir(src)?;
    if !src.join(MANIFEST).exists() {
        let dir = src.display().to_string();
        return Err(match src.join(HF_CONFIG).exists() {
            true => CkptError::NotShards { dir },
            false => CkptError::UnknownDir { dir },
        });
    }
    let mut sh = shards::open(src, Then::Export)?;
    let shape = &sh.manifest.model.shape;
    let hf = hf_tensors(shape);
    let mut pieces = invert(&std::mem::take(&mut sh.plan), &hf).expect("shard plans cover every tensor");
    let tensors: Vec<TensorPlan> = hf
        .into_iter()
        .map(|(name, shape)| TensorPlan { pieces: pieces.remove(&name).unwrap_or_default(), name, shape })
        .collect();
    let e = sh.dtype.size() as u64;
    // Greedy split in state_dict order, as transformers' save_pretrained does.
    let mut groups: Vec<Vec<TensorPlan>> = vec![Vec::new()];
    let mut size = 0;
    for t in tensors {
        let b = t.shape.iter().product::<u64>() * e;
        if size > 0 && size + b > HF_SHARD_BYTES {
            groups.push(Vec::new());
            size = 0;
        }
        size += b;
        groups.last_mut().expect("non-empty").push(t);
    }
    let staging = Staging::new(dst)?;
    let total: u64 = groups.iter().flatten().map(|t| t.shape.iter().product::<u64>() * e).sum();
    let progress = Reporter::new("export", Some(total), "bytes");
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let n = groups.len();
    let names: Vec<String> =
        (0..n)
            .map(|i| {
                if n == 1 {
                    "model.safetensors".to_string()
                } else {
                    format!("model-{:05}-of-{n:05}.safetensors", i + 1)
                }
            })
            .collect();
    groups.par_iter().zip(&names).try_for_each(|(g, name)| {
        write_file(&staging.dir().join(name), g, sh.dtype, &meta, &sh.sources, &progress).map(|_| ())
    })?;
    if n > 1 {
        let mut map = serde_json::Map::new();
        for (g, name) in groups.iter().zip(&names) {
            for t in g {
                map.insert(t.name.clone(), Value::String(name.clone()));
            }
        }
        let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": map});
        write_json(&staging.dir().join(INDEX), &index)?;
    }
    let mut config = shards::hf_config(src)?;
    if let Some(obj) = config.as_object_mut() {
        let key = if obj.contains_key("torch_dtype") && !obj.contains_key("dtype") { "torch_dtype" } else { "dtype" };
        obj.insert(key.into(), Value::String(dtype_name(sh.dtype).into()));
    }
    write_json(&staging.dir().join("config.json"), &config)?;
    copy_tokenizer(src, Some(TOKENIZER_DIR), staging.dir())?;
    copy_inside(src, GENERATION_CONFIG, &staging.dir().join(GENERATION_CONFIG))?;
    progress.finish();
    staging.commit()
}

pub fn write_json(path: &Path, v: &Value) -> Result<(), CkptError> {
    let mut text = serde_json::to_string_pretty(v).expect("json");
    text.push('\n');
    std::fs::write(path, text).map_err(io(path))
}
