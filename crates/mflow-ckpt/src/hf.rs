//! Hugging Face model directories: reading config.json and the safetensors weights (single file
//! or sharded with model.safetensors.index.json), and checking them against each other.

use std::collections::{BTreeMap, BTreeSet};
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use mflow_untrusted::json::ParseError;
use rayon::prelude::*;
use safetensors::Dtype;
use serde_json::Value;

use crate::error::{io, CkptError};
use crate::layout::hf_tensors;
use crate::memory;
use crate::shape::{from_hf_config, Architecture, ModelShape};
use crate::st::StFile;
use crate::untrusted::{copy_inside, excerpt, excerpt_of, read_bounded, resolve_inside, FileError};
use crate::writer::Sources;

/// Largest JSON document read (config.json, the index, the manifest): real ones are kilobytes,
/// the index of a very large sharded model about ten megabytes.
pub const MAX_JSON_BYTES: u64 = 32 << 20;
/// Longest file name accepted from an index (the usual file system limit).
const MAX_NAME_BYTES: usize = 255;

pub const INDEX: &str = "model.safetensors.index.json";
/// Tokenizer files carried along with a model, when present.
pub const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
];
const PICKLE_SUFFIXES: &[&str] = &[".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"];

/// An opened Hugging Face checkpoint.
pub struct HfModel {
    pub dir: PathBuf,
    pub config: Value,
    pub shape: ModelShape,
    pub dtype: Dtype,
    pub sources: Sources,
}

/// Reads a JSON file of at most [`MAX_JSON_BYTES`] that must be a regular file, once the memory
/// budget has agreed to what its value will hold (nested arrays hold a hundred times their
/// text).
pub fn read_json(path: &Path) -> Result<Value, CkptError> {
    let bytes = read_bounded(path, MAX_JSON_BYTES)?;
    let file = path.display().to_string();
    mflow_untrusted::json::parse(&bytes).map_err(|e| match e {
        ParseError::Syntax(e) => CkptError::Config {
            file,
            key: "(document)".into(),
            reason: format!("not valid JSON: {e}"),
            help: "fix or regenerate the file".into(),
        },
        ParseError::Setting(e) => e.into(),
        ParseError::OverBudget(over) => CkptError::OverBudget { file, over: Box::new(over) },
    })
}

/// Reads `dir/name`, which must resolve inside `dir`.
pub fn read_json_in(dir: &Path, name: &str) -> Result<Value, CkptError> {
    let path = dir.join(name);
    resolve_inside(dir, name)?.ok_or_else(|| FileError::Open {
        file: path.display().to_string(),
        source: std::io::Error::new(ErrorKind::NotFound, "no such file"),
    })?;
    read_json(&path)
}

/// Refuses a model directory that is not there, which its missing files would only hint at.
pub fn check_source_dir(dir: &Path) -> Result<(), CkptError> {
    let problem = match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => return Ok(()),
        Ok(_) => "is not a directory",
        Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory) => "does not exist",
        Err(e) => return Err(io(dir)(e)),
    };
    Err(CkptError::SourceDir { dir: dir.display().to_string(), problem })
}

pub fn read_config(dir: &Path) -> Result<(Value, ModelShape), CkptError> {
    let path = dir.join("config.json");
    let config = read_json_in(dir, "config.json")?;
    let shape = from_hf_config(&path.display().to_string(), &config)?;
    Ok((config, shape))
}

/// Weight files of a model directory (relative names), refusing pickles.
pub fn weight_files(dir: &Path) -> Result<Vec<String>, CkptError> {
    Ok(weight_map(dir)?.0)
}

/// An index's `weight_map`: tensor -> file.
type WeightMap = serde_json::Map<String, Value>;

/// The weight files, and for a sharded model its index's `weight_map`, kept as read rather than
/// copied.
fn weight_map(dir: &Path) -> Result<(Vec<String>, Option<WeightMap>), CkptError> {
    let index = dir.join(INDEX);
    let single = dir.join("model.safetensors");
    if index.symlink_metadata().is_ok() && single.symlink_metadata().is_ok() {
        return Err(CkptError::TwoWeights { dir: dir.display().to_string() });
    }
    if index.exists() {
        let v = read_json_in(dir, INDEX)?;
        let map = match v {
            Value::Object(mut o) => o.remove("weight_map"),
            _ => None,
        };
        let Some(Value::Object(map)) = map else {
            return Err(CkptError::Config {
                file: index.display().to_string(),
                key: "weight_map".into(),
                reason: "missing or not an object".into(),
                help: "regenerate the index with transformers' save_pretrained".into(),
            });
        };
        let mut files = BTreeSet::new();
        for (tensor, f) in &map {
            let name = f.as_str().filter(|n| is_plain_name(n) && n.ends_with(".safetensors")).ok_or_else(|| {
                CkptError::Config {
                    file: index.display().to_string(),
                    key: format!("weight_map.{tensor}"),
                    reason: format!("{} is not a .safetensors file name inside the model directory", excerpt_of(f)),
                    help: "entries must be plain file names such as model-00001-of-00002.safetensors".into(),
                }
            })?;
            if !files.contains(name) {
                files.insert(name.to_string());
            }
        }
        return Ok((files.into_iter().collect(), Some(map)));
    }
    if single.exists() {
        return Ok((vec!["model.safetensors".into()], None));
    }
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let name = entry.map_err(io(dir))?.file_name().to_string_lossy().into_owned();
        if PICKLE_SUFFIXES.iter().any(|s| name.ends_with(s)) {
            return Err(CkptError::Pickle { file: dir.join(name).display().to_string() });
        }
    }
    Err(CkptError::NoWeights { dir: dir.display().to_string() })
}

/// A file name without directories, so that it cannot escape the model directory.
pub fn is_plain_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= MAX_NAME_BYTES
        && n != "."
        && n != ".."
        && !n.contains('/')
        && !n.contains('\\')
        && !n.contains('\0')
}

/// Tensors that may appear in a Hugging Face checkpoint without being weights mflow moves.
fn ignorable(shape: &ModelShape, name: &str) -> bool {
    name.ends_with(".rotary_emb.inv_freq")
        || (shape.architecture == Architecture::Gpt2
            && (name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")))
        || (shape.share_embeddings_and_output_weights && name == "lm_head.weight")
}

/// The name a tensor goes by in mflow's plans (GPT-2 files sometimes omit `transformer.`).
fn canonical(shape: &ModelShape, name: &str) -> String {
    if shape.architecture == Architecture::Gpt2 && !name.starts_with("transformer.") && name != "lm_head.weight" {
        format!("transformer.{name}")
    } else {
        name.to_string()
    }
}

pub fn open(dir: &Path) -> Result<HfModel, CkptError> {
    let (config, shape) = read_config(dir)?;
    let (files, named) = weight_map(dir)?;
    let label = if files.len() == 1 { dir.join(&files[0]) } else { dir.join(INDEX) };
    // Every header stays in memory while the files are open: their sizes are asked for first.
    memory::check_headers(dir, &files, &label)?;
    let opened: Vec<StFile> = files
        .par_iter()
        .map(|f| {
            // Resolves links first so that a weight file cannot be read from outside `dir`.
            resolve_inside(dir, f)?;
            Ok(StFile::open(&dir.join(f))?)
        })
        .collect::<Result<_, CkptError>>()?;
    let weights_label = label.display().to_string();
    let mut sources = Sources::default();
    let embedding = hf_tensors(&shape).into_iter().next().map(|(_, s)| s);
    for (i, f) in opened.iter().enumerate() {
        for (name, meta) in &f.header.tensors {
            if ignorable(&shape, name) {
                // A tied output layer is the embedding, as transformers loads it; one saved all
                // the same must at least be the embedding's shape, or the file is not this model.
                if name == "lm_head.weight" && embedding.as_ref().is_some_and(|e| *e != meta.shape) {
                    return Err(CkptError::Shape {
                        file: f.path.display().to_string(),
                        tensor: name.clone(),
                        found: meta.shape.clone(),
                        expected: embedding.unwrap_or_default(),
                        reason: format!(
                            "the embedding it is tied to (tie_word_embeddings in {})",
                            dir.join("config.json").display()
                        ),
                    });
                }
                continue;
            }
            let key = canonical(&shape, name);
            if let Some((j, other)) = sources.index.insert(key.clone(), (i, name.clone())) {
                return Err(ambiguous(dir, &key, (&files[j], &other), (&files[i], name), named.as_ref()));
            }
        }
    }
    // Copies are told first; then a tensor found elsewhere than the index says means the index
    // belongs to other files, and which of them is right is not mflow's guess either.
    for (i, name) in sources.index.values() {
        if let Some(said) = named.as_ref().and_then(|m| m.get(name)?.as_str()).filter(|s| *s != files[*i]) {
            return Err(CkptError::IndexMismatch {
                index: dir.join(INDEX).display().to_string(),
                tensor: name.clone(),
                named: dir.join(said).display().to_string(),
                found: dir.join(&files[*i]).display().to_string(),
            });
        }
    }
    if let Some(map) = &named {
        check_index_held(dir, map, &opened)?;
    }
    sources.files = opened;
    // The layer count sizes the whole plan: check it against the weights before planning.
    check_layer_count(
        &shape,
        sources.index.keys().map(String::as_str),
        &dir.join("config.json").display().to_string(),
        &weights_label,
    )?;
    let expected = hf_tensors(&shape);
    let dtype = check_tensors(&sources, &expected, &weights_label, &dir.join("config.json").display().to_string())?;
    Ok(HfModel { dir: dir.to_path_buf(), config, shape, dtype, sources })
}

/// Refuses an index naming a tensor that no weight file holds: it is the index of other weights.
fn check_index_held(dir: &Path, map: &WeightMap, opened: &[StFile]) -> Result<(), CkptError> {
    let held = |t: &String| opened.iter().any(|f| f.header.tensors.contains_key(t));
    match map.iter().find(|(t, _)| !held(t)) {
        Some((tensor, file)) => Err(CkptError::IndexUnheld {
            index: dir.join(INDEX).display().to_string(),
            tensor: tensor.clone(),
            named: dir.join(file.as_str().unwrap_or_default()).display().to_string(),
        }),
        None => Ok(()),
    }
}

/// A weight held twice (in two files, or under two spellings of its name in one): which copy
/// to take is not mflow's guess to make.
fn ambiguous(
    dir: &Path,
    key: &str,
    first: (&String, &String),
    second: (&String, &String),
    named: Option<&WeightMap>,
) -> CkptError {
    let at = |(file, name): (&String, &String)| {
        let path = dir.join(file).display().to_string();
        if name == key {
            path
        } else {
            format!("{path} (as `{}`)", excerpt(name))
        }
    };
    let index = [first.1, second.1].into_iter().find_map(|n| named?.get(n)?.as_str());
    let help = match index {
        Some(file) => {
            format!("{INDEX} names {file} for it; remove the other copy, or save the model again with save_pretrained")
        }
        None => "remove one of the copies, or save the model again with transformers' save_pretrained".into(),
    };
    CkptError::Ambiguous { tensor: key.to_string(), first: at(first), second: at(second), help }
}

/// The layer index of a canonical Hugging Face tensor name, if it is a layer tensor.
fn layer_index(shape: &ModelShape, name: &str) -> Option<u64> {
    let prefix = if shape.architecture == Architecture::Gpt2 { "transformer.h." } else { "model.layers." };
    let rest = name.strip_prefix(prefix)?;
    rest.split_once('.')?.0.parse().ok()
}

/// Refuses a config whose layer count differs from the number of layers the weights hold,
/// before any per-layer plan is made from it.
fn check_layer_count<'a>(
    shape: &ModelShape,
    names: impl Iterator<Item = &'a str>,
    config: &str,
    weights: &str,
) -> Result<(), CkptError> {
    let layers: BTreeSet<u64> = names.filter_map(|n| layer_index(shape, n)).collect();
    if layers.len() as u64 == shape.num_layers {
        return Ok(());
    }
    let key = if shape.architecture == Architecture::Gpt2 { "n_layer" } else { "num_hidden_layers" };
    Err(CkptError::Count {
        file: config.into(),
        key: key.into(),
        found: shape.num_layers,
        present: format!("{} layers ({weights})", layers.len()),
        help: "config.json and the weights disagree; fix config.json or use the weights it was written for".into(),
    })
}

/// Checks that the sources hold exactly the expected tensors with the expected shapes and one
/// float dtype, which is returned.
pub fn check_tensors(
    sources: &Sources,
    expected: &[(String, Vec<u64>)],
    label: &str,
    config_label: &str,
) -> Result<Dtype, CkptError> {
    let wanted: BTreeMap<&str, &Vec<u64>> = expected.iter().map(|(n, s)| (n.as_str(), s)).collect();
    let mut unexpected: Vec<&String> = sources.index.keys().filter(|k| !wanted.contains_key(k.as_str())).collect();
    unexpected.sort();
    if let Some(k) = unexpected.first() {
        let (f, name) = &sources.index[*k];
        return Err(CkptError::UnexpectedTensor {
            file: sources.files[*f].path.display().to_string(),
            tensor: name.clone(),
        });
    }
    let mut dtype: Option<(Dtype, String)> = None;
    for (name, shape) in expected {
        let Some((f, meta)) = sources.get(name) else {
            return Err(CkptError::MissingTensor { file: label.into(), tensor: name.clone() });
        };
        let file = f.path.display().to_string();
        if !matches!(meta.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            return Err(CkptError::Dtype {
                file,
                tensor: name.clone(),
                found: format!("{:?}", meta.dtype),
                expected: "a float dtype".into(),
            });
        }
        match &dtype {
            None => dtype = Some((meta.dtype, name.clone())),
            Some((d, first)) if *d != meta.dtype => {
                return Err(CkptError::Dtype {
                    file,
                    tensor: name.clone(),
                    found: dtype_name(meta.dtype).into(),
                    expected: format!("{} (like `{first}`)", dtype_name(*d)),
                })
            }
            _ => {}
        }
        if &meta.shape != shape {
            let vocab = name.contains("embed_tokens") || name.contains("wte") || name.starts_with("lm_head");
            let reason =
                if vocab { format!("vocab_size = {} in {config_label}", shape[0]) } else { config_label.to_string() };
            return Err(CkptError::Shape {
                file,
                tensor: name.clone(),
                found: meta.shape.clone(),
                expected: shape.clone(),
                reason,
            });
        }
    }
    Ok(dtype.map(|d| d.0).unwrap_or(Dtype::F32))
}

pub fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F32 => "float32",
        Dtype::BF16 => "bfloat16",
        Dtype::F16 => "float16",
        _ => "unsupported",
    }
}

pub fn dtype_from_name(n: &str) -> Option<Dtype> {
    match n {
        "float32" => Some(Dtype::F32),
        "bfloat16" => Some(Dtype::BF16),
        "float16" => Some(Dtype::F16),
        _ => None,
    }
}

/// Copies whichever tokenizer files exist in `root/sub` into `to`; each must resolve inside
/// `root` (a linked `tokenizer/` directory is held to the same rule as its files).
pub fn copy_tokenizer(root: &Path, sub: Option<&str>, to: &Path) -> Result<(), CkptError> {
    for name in TOKENIZER_FILES {
        let rel = match sub {
            Some(s) => format!("{s}/{name}"),
            None => name.to_string(),
        };
        copy_inside(root, &rel, &to.join(name))?;
    }
    Ok(())
}

/// Validates a local Hugging Face model directory and copies its config, safetensors weights,
/// tokenizer and generation files to `dst` (staged, then renamed). Pickle files are not copied.
pub fn copy_model(src: &Path, dst: &Path) -> Result<(), CkptError> {
    check_source_dir(src)?;
    let model = open(src)?;
    drop(model);
    let staging = crate::writer::Staging::new(dst)?;
    let mut names: Vec<String> = weight_files(src)?;
    names.push("config.json".into());
    if src.join(INDEX).exists() {
        names.push(INDEX.into());
    }
    names.extend(["generation_config.json"].iter().chain(TOKENIZER_FILES).map(|s| s.to_string()));
    for name in names {
        copy_inside(src, &name, &staging.dir().join(&name))?;
    }
    staging.commit()
}
