//! The mflow Megatron shards directory: `mflow-checkpoint.json` plus one safetensors file per
//! (tp, pp) rank, `tokenizer/` and `hf_config.json`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use safetensors::Dtype;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{io, CkptError};
use crate::hf::{dtype_from_name, read_json_in};
use crate::layout::{rank_file_name, rank_key, shard_plan, RankPlan};
use crate::memory;
use crate::shape::{check_parallelism, ModelShape};
use crate::st::StFile;
use crate::untrusted::{excerpt, resolve_inside};
use crate::writer::Sources;

/// Most rank files a manifest may list (tp * pp); far above any real layout.
pub const MAX_RANKS: u64 = 1 << 16;

pub const MANIFEST: &str = "mflow-checkpoint.json";
pub const FORMAT: &str = "mflow-megatron-shards";
pub const VERSION: u32 = 1;
pub const HF_CONFIG: &str = "hf_config.json";
pub const TOKENIZER_DIR: &str = "tokenizer";
pub const GENERATION_CONFIG: &str = "generation_config.json";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub architecture: String,
    pub dtype: String,
    pub tp: u32,
    pub pp: u32,
    pub layers_per_stage: Vec<u64>,
    pub model: ManifestModel,
    pub files: Vec<FileEntry>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ManifestModel {
    #[serde(flatten)]
    pub shape: ModelShape,
    pub padded_vocab_size: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FileEntry {
    pub tp: u32,
    pub pp: u32,
    pub path: String,
    pub bytes: u64,
    pub blake3: String,
}

/// An opened, verified shards directory.
pub struct Shards {
    pub dir: PathBuf,
    pub manifest: Manifest,
    pub dtype: Dtype,
    pub plan: Vec<RankPlan>,
    /// Rank tensors keyed by [`rank_key`].
    pub sources: Sources,
}

fn bad(file: &Path, key: &str, reason: String) -> CkptError {
    CkptError::Config {
        file: file.display().to_string(),
        key: key.into(),
        reason,
        help: "regenerate the shards with `mflow convert`".into(),
    }
}

pub fn read_manifest(dir: &Path) -> Result<Manifest, CkptError> {
    let path = dir.join(MANIFEST);
    let value = read_json_in(dir, MANIFEST)?;
    parse_manifest(&path, value)
}

/// Checks a parsed mflow-checkpoint.json: format, version, and every count against its bound
/// and the others. Never panics (fuzzed).
pub fn parse_manifest(path: &Path, value: Value) -> Result<Manifest, CkptError> {
    let m: Manifest = serde_json::from_value(value).map_err(|e| bad(path, "(document)", e.to_string()))?;
    let path = path.to_path_buf();
    if m.format != FORMAT {
        return Err(bad(&path, "format", format!("is `{}`, expected `{FORMAT}`", excerpt(&m.format))));
    }
    if m.version != VERSION {
        return Err(bad(&path, "version", format!("is {}, this mflow reads version {VERSION}", m.version)));
    }
    check_counts(&path, &m)?;
    Ok(m)
}

/// Checks the manifest's sizes against their bounds and against each other (ranks against
/// files, stages against layers), so that nothing is planned from a number the rest of the
/// manifest does not back.
fn check_counts(path: &Path, m: &Manifest) -> Result<(), CkptError> {
    let file = path.display().to_string();
    m.model.shape.validate(&file)?;
    if m.tp == 0 || m.pp == 0 {
        return Err(bad(path, if m.tp == 0 { "tp" } else { "pp" }, "is 0; it must be at least 1".into()));
    }
    let ranks = m.tp as u64 * m.pp as u64;
    if ranks > MAX_RANKS {
        return Err(CkptError::TooLarge { file, key: "tp * pp".into(), value: ranks.to_string(), limit: MAX_RANKS });
    }
    if ranks != m.files.len() as u64 {
        return Err(bad(path, "files", format!("lists {} files but tp * pp = {ranks}", m.files.len())));
    }
    if m.layers_per_stage.len() as u64 != m.pp as u64 {
        return Err(bad(
            path,
            "layers_per_stage",
            format!("has {} entries but pp = {}", m.layers_per_stage.len(), m.pp),
        ));
    }
    let per_stage = m.model.shape.num_layers / m.pp as u64;
    if m.layers_per_stage.iter().any(|&n| n != per_stage) || per_stage * m.pp as u64 != m.model.shape.num_layers {
        let reason = format!(
            "must be {} entries of {per_stage} (model.num_layers = {} split evenly)",
            m.pp, m.model.shape.num_layers
        );
        return Err(bad(path, "layers_per_stage", reason));
    }
    Ok(())
}

/// What a shards directory is opened for: the memory it will take is asked for as a whole,
/// before its files are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Then {
    /// Back to Hugging Face weights.
    Export,
    /// To shards at another tp x pp.
    Reshard { tp: u32, pp: u32 },
}

pub fn open(dir: &Path, then: Then) -> Result<Shards, CkptError> {
    let path = dir.join(MANIFEST);
    let m = read_manifest(dir)?;
    let shape = &m.model.shape;
    let dtype = dtype_from_name(&m.dtype)
        .ok_or_else(|| bad(&path, "dtype", format!("`{}` is not float32, bfloat16 or float16", excerpt(&m.dtype))))?;
    check_parallelism(shape, m.tp, m.pp)?;
    if m.model.padded_vocab_size != shape.padded_vocab(m.tp) {
        return Err(bad(
            &path,
            "model.padded_vocab_size",
            format!("is {}, expected {} for tp = {}", m.model.padded_vocab_size, shape.padded_vocab(m.tp), m.tp),
        ));
    }
    let expected: BTreeSet<(u32, u32)> = (0..m.pp).flat_map(|p| (0..m.tp).map(move |t| (t, p))).collect();
    let listed: BTreeSet<(u32, u32)> = m.files.iter().map(|f| (f.tp, f.pp)).collect();
    if listed != expected || m.files.len() != expected.len() {
        return Err(bad(
            &path,
            "files",
            format!("must list each of the {} (tp, pp) ranks exactly once", expected.len()),
        ));
    }
    for f in &m.files {
        if f.path != rank_file_name(f.tp, f.pp) {
            return Err(bad(
                &path,
                "files[].path",
                format!("`{}` should be `{}`", excerpt(&f.path), rank_file_name(f.tp, f.pp)),
            ));
        }
    }
    check_memory(dir, &m, then)?;
    let opened = open_rank_files(dir, &m)?;
    // Every rank file must hold its stage's layers before per-layer plans are made.
    let per_stage = shape.num_layers / m.pp as u64;
    for file in &opened {
        let layers: BTreeSet<u64> = file
            .header
            .tensors
            .keys()
            .filter_map(|n| n.strip_prefix("decoder.layers.")?.split_once('.')?.0.parse().ok())
            .collect();
        if layers.len() as u64 != per_stage {
            return Err(CkptError::Count {
                file: path.display().to_string(),
                key: "model.num_layers".into(),
                found: shape.num_layers,
                present: format!(
                    "{} layers in {} ({per_stage} expected per stage for pp = {})",
                    layers.len(),
                    file.path.display(),
                    m.pp
                ),
                help: "the manifest and the rank files disagree; regenerate the shards with `mflow convert`".into(),
            });
        }
    }
    check_against_config(dir, &m)?;
    let plan = shard_plan(shape, m.tp, m.pp);
    let mut sources = Sources::default();
    for (i, (entry, file)) in m.files.iter().zip(&opened).enumerate() {
        let rank = plan.iter().find(|r| r.tp == entry.tp && r.pp == entry.pp).expect("every rank is planned");
        let wanted: BTreeMap<&str, &Vec<u64>> = rank.tensors.iter().map(|t| (t.name.as_str(), &t.shape)).collect();
        let fname = file.path.display().to_string();
        for (name, meta) in &file.header.tensors {
            let Some(shape) = wanted.get(name.as_str()) else {
                return Err(CkptError::UnexpectedTensor { file: fname, tensor: name.clone() });
            };
            if &meta.shape != *shape {
                return Err(CkptError::Shape {
                    file: fname,
                    tensor: name.clone(),
                    found: meta.shape.clone(),
                    expected: (*shape).clone(),
                    reason: MANIFEST.into(),
                });
            }
            if meta.dtype != dtype {
                return Err(CkptError::Dtype {
                    file: fname,
                    tensor: name.clone(),
                    found: format!("{:?}", meta.dtype),
                    expected: m.dtype.clone(),
                });
            }
            sources.index.insert(rank_key(entry.tp, entry.pp, name), (i, name.clone()));
        }
        for name in wanted.keys() {
            if !file.header.tensors.contains_key(*name) {
                return Err(CkptError::MissingTensor { file: fname, tensor: name.to_string() });
            }
        }
    }
    sources.files = opened;
    crate::replicas::check(&plan, &sources)?;
    Ok(Shards { dir: dir.to_path_buf(), manifest: m, dtype, plan, sources })
}

/// Refuses past the memory budget what the operation `then` will hold, sized from the manifest
/// `m` of `dir` before any rank file is read: its plans, then the rank files' headers.
fn check_memory(dir: &Path, m: &Manifest, then: Then) -> Result<(), CkptError> {
    let path = dir.join(MANIFEST);
    let shape = &m.model.shape;
    let (need, doing) = match then {
        Then::Export => {
            (memory::export_need(shape, m.tp, m.pp), format!("exporting shards of tp = {}, pp = {}", m.tp, m.pp))
        }
        Then::Reshard { tp, pp } => {
            check_parallelism(shape, tp, pp)?;
            let doing = format!("resharding tp = {}, pp = {} to tp = {tp}, pp = {pp}", m.tp, m.pp);
            (memory::reshard_need(shape, (m.tp, m.pp), (tp, pp)), doing)
        }
    };
    memory::check(&path, memory::what(&doing, shape), need)?;
    let names: Vec<String> = m.files.iter().map(|f| f.path.clone()).collect();
    memory::check_headers(dir, &names, &path)
}

/// Opens the rank files `m` lists, each checked against its recorded size and blake3 first.
fn open_rank_files(dir: &Path, m: &Manifest) -> Result<Vec<StFile>, CkptError> {
    m.files
        .par_iter()
        .map(|f| {
            let p = dir.join(&f.path);
            // Regular files inside the directory only: no FIFO to block on, no link out.
            resolve_inside(dir, &f.path)?;
            let len = std::fs::metadata(&p).map_err(io(&p))?.len();
            if len != f.bytes {
                return Err(CkptError::Integrity {
                    file: p.display().to_string(),
                    what: "size".into(),
                    expected: f.bytes.to_string(),
                    found: len.to_string(),
                });
            }
            let digest = blake3_of(&p).map_err(io(&p))?;
            if digest != f.blake3 {
                return Err(CkptError::Integrity {
                    file: p.display().to_string(),
                    what: "blake3".into(),
                    expected: f.blake3.clone(),
                    found: digest,
                });
            }
            Ok(StFile::open(&p)?)
        })
        .collect()
}

/// Bytes hashed at a time: each window leaves the resident set once hashed, so that checking a
/// rank file of many GB does not hold it all in memory (a mapped page counts as resident).
const HASH_WINDOW: usize = 16 << 20;

/// The blake3 digest of a regular file, hashed a window at a time on all cores.
fn blake3_of(path: &Path) -> std::io::Result<String> {
    let file = mflow_untrusted::open_regular(path)?;
    let mut h = blake3::Hasher::new();
    if file.metadata()?.len() > 0 {
        // SAFETY: the map is read-only; mflow never writes its inputs while reading them.
        let map = unsafe { memmap2::Mmap::map(&file) }?;
        for (i, window) in map.chunks(HASH_WINDOW).enumerate() {
            h.update_rayon(window);
            // SAFETY: DontNeed on a private read-only file map only drops our page-table
            // entries; the bytes stay in the file and the page cache.
            let _ = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, i * HASH_WINDOW, window.len())
            };
        }
    }
    Ok(h.finalize().to_hex().to_string())
}

/// Builds the manifest for freshly written rank files.
pub fn manifest(shape: &ModelShape, tp: u32, pp: u32, dtype: Dtype, files: Vec<FileEntry>) -> Manifest {
    Manifest {
        format: FORMAT.into(),
        version: VERSION,
        architecture: shape.architecture.name().into(),
        dtype: crate::hf::dtype_name(dtype).into(),
        tp,
        pp,
        layers_per_stage: vec![shape.num_layers / pp as u64; pp as usize],
        model: ManifestModel { shape: shape.clone(), padded_vocab_size: shape.padded_vocab(tp) },
        files,
    }
}

/// The manifest's model against the Hugging Face config it was made from, which export writes
/// out as config.json: neither file is covered by a digest, and a shape they disagree on would
/// give a model whose config does not describe its weights.
fn check_against_config(dir: &Path, m: &Manifest) -> Result<(), CkptError> {
    let config = dir.join(HF_CONFIG);
    let says = crate::shape::from_hf_config(&config.display().to_string(), &hf_config(dir)?)?;
    let [ours, theirs] = [&m.model.shape, &says].map(|s| serde_json::to_value(s).expect("a shape is JSON"));
    let differs = ours.as_object().and_then(|o| o.iter().find(|(k, v)| theirs.get(k.as_str()) != Some(v)));
    let differs = match differs {
        Some((key, value)) => Some((format!("model.{key}"), value.to_string(), theirs[key.as_str()].to_string())),
        None if m.architecture != says.architecture.name() => {
            Some(("architecture".into(), format!("{:?}", m.architecture), format!("{:?}", says.architecture.name())))
        }
        None => None,
    };
    match differs {
        Some((key, ours, theirs)) => Err(CkptError::Config {
            file: dir.join(MANIFEST).display().to_string(),
            key,
            reason: format!("is {}, but {} says {}", excerpt(&ours), config.display(), excerpt(&theirs)),
            help: "the manifest and the model's config disagree, so which one describes the weights is not known; regenerate the shards with `mflow convert`".into(),
        }),
        None => Ok(()),
    }
}

/// The original Hugging Face config carried in a shards directory.
pub fn hf_config(dir: &Path) -> Result<Value, CkptError> {
    read_json_in(dir, HF_CONFIG)
}
