//! Errors of checkpoint reading, conversion and export.

use miette::Diagnostic;
use thiserror::Error;

use crate::st::StError;
use crate::untrusted::{excerpt, excerpt_of, FileError};

#[derive(Debug, Error, Diagnostic)]
pub enum CkptError {
    #[error(transparent)]
    #[diagnostic(transparent)]
    Safetensors(#[from] StError),

    #[error(transparent)]
    #[diagnostic(transparent)]
    Hub(#[from] crate::hub::HubError),

    #[error(transparent)]
    #[diagnostic(transparent)]
    File(#[from] FileError),

    #[error("{file}: `{key}` is {found} but the weights hold {present}")]
    #[diagnostic(code(mflow::ckpt::count), help("{help}"))]
    Count { file: String, key: String, found: u64, present: String, help: String },

    #[error("{file}: `{key}` = {value} is larger than {limit}, the most mflow accepts")]
    #[diagnostic(
        code(mflow::ckpt::too_large),
        help("the file is corrupt or not the model it claims to be; no supported model comes near this")
    )]
    TooLarge { file: String, key: String, value: String, limit: u64 },

    #[error("{path}: I/O error")]
    #[diagnostic(code(mflow::ckpt::io), help("check the path and its permissions, and that the disk is not full"))]
    Io { path: String, source: std::io::Error },

    #[error("{file}: `{}`: {}", excerpt(.key), excerpt(.reason))]
    #[diagnostic(code(mflow::ckpt::config), help("{help}"))]
    Config { file: String, key: String, reason: String, help: String },

    #[error(
        "{dir}: not a Hugging Face model directory or mflow shards directory (no config.json or mflow-checkpoint.json)"
    )]
    #[diagnostic(
        code(mflow::ckpt::unknown_dir),
        help("point at a directory made by `mflow model` or `mflow convert`")
    )]
    UnknownDir { dir: String },

    #[error("model directory {dir} {problem}")]
    #[diagnostic(
        code(mflow::ckpt::source_dir),
        help("check the path: it must name the directory of a model (a Hugging Face model, or shards made by `mflow convert`)")
    )]
    SourceDir { dir: String, problem: &'static str },

    #[error("{dir}: a Hugging Face model, not mflow shards (no mflow-checkpoint.json): export reads shards")]
    #[diagnostic(
        code(mflow::ckpt::not_shards),
        help("convert it first (`mflow convert DIR OUT --tp 1`), or point at a convert or train stage's output")
    )]
    NotShards { dir: String },

    #[error("{file}: pickle checkpoints are refused")]
    #[diagnostic(code(mflow::ckpt::pickle), help("convert the model to safetensors first (e.g. with transformers' save_pretrained(safe_serialization=True)); pickle files can run arbitrary code"))]
    Pickle { file: String },

    #[error("{dir}: holds both model.safetensors and model.safetensors.index.json, so which weights are the model's is not known")]
    #[diagnostic(
        code(mflow::ckpt::two_weights),
        help("remove the one that is not the model: transformers would load model.safetensors and ignore the index's shards")
    )]
    TwoWeights { dir: String },

    #[error("{dir}: no model.safetensors or model.safetensors.index.json")]
    #[diagnostic(code(mflow::ckpt::no_weights), help("the model directory must hold safetensors weights"))]
    NoWeights { dir: String },

    #[error("{file}: tensor `{}` is missing", excerpt(.tensor))]
    #[diagnostic(
        code(mflow::ckpt::missing_tensor),
        help("the weights do not match config.json; the checkpoint is incomplete or of another architecture")
    )]
    MissingTensor { file: String, tensor: String },

    #[error("{file}: unexpected tensor `{}`", excerpt(.tensor))]
    #[diagnostic(code(mflow::ckpt::unexpected_tensor), help("the weights do not match config.json (another architecture or option such as biases); mflow refuses to drop weights silently"))]
    UnexpectedTensor { file: String, tensor: String },

    #[error("tensor `{}` is held twice: in {first} and in {second}", excerpt(.tensor))]
    #[diagnostic(code(mflow::ckpt::ambiguous_tensor), help("{help}"))]
    Ambiguous { tensor: String, first: String, second: String, help: String },

    #[error("{index}: `weight_map` names {named} for tensor `{}`, but it is in {found}", excerpt(.tensor))]
    #[diagnostic(
        code(mflow::ckpt::index_mismatch),
        help("the index and the weight files disagree, so which one is right is not known; save the model again with transformers' save_pretrained")
    )]
    IndexMismatch { index: String, tensor: String, named: String, found: String },

    #[error("{index}: `weight_map` names {named} for tensor `{}`, but no weight file holds it", excerpt(.tensor))]
    #[diagnostic(
        code(mflow::ckpt::index_unheld_tensor),
        help("the index and the weight files disagree, so which one is right is not known; save the model again with transformers' save_pretrained")
    )]
    IndexUnheld { index: String, tensor: String, named: String },

    #[error("{file}: tensor `{}` has shape {} but {expected:?} was expected from {reason}", excerpt(.tensor), excerpt_of(&format_args!("{:?}", .found)))]
    #[diagnostic(
        code(mflow::ckpt::shape),
        help("config.json and the weights disagree; fix config.json or use the weights it was written for")
    )]
    Shape { file: String, tensor: String, found: Vec<u64>, expected: Vec<u64>, reason: String },

    #[error("{file}: tensor `{}` is {found} but the checkpoint is {}", excerpt(.tensor), excerpt(.expected))]
    #[diagnostic(
        code(mflow::ckpt::dtype),
        help("all weights must share one floating-point dtype (float32, bfloat16 or float16)")
    )]
    Dtype { file: String, tensor: String, found: String, expected: String },

    #[error("{file}: recorded {what} {} but the file has {found}", excerpt(.expected))]
    #[diagnostic(
        code(mflow::ckpt::integrity),
        help("the shards were changed or damaged after they were written; convert again")
    )]
    Integrity { file: String, what: String, expected: String, found: String },

    #[error("{copy} and {first} are copies of `{hf}`, but they differ")]
    #[diagnostic(
        code(mflow::ckpt::replicas),
        help("the shards are not consistent (a replicated norm or the tied output layer of the last stage was changed on one rank); which copy is right is not known, so neither is taken: regenerate the shards, or fix what wrote them")
    )]
    /// `first` and `copy` as "`tensor` of file".
    Replicas { hf: String, first: String, copy: String },

    #[error("{field} = {value} is not divisible by {by} = {divisor}")]
    #[diagnostic(code(mflow::ckpt::parallelism), help("{help}"))]
    Parallelism { field: String, value: u64, by: String, divisor: u64, help: String },

    #[error("{path}: already exists and is not an empty directory")]
    #[diagnostic(code(mflow::ckpt::destination_exists), help("choose a new destination or remove the existing one"))]
    DestinationExists { path: String },

    #[error("{path}: is a symbolic link; mflow does not write an output through a link")]
    #[diagnostic(
        code(mflow::ckpt::destination_link),
        help("choose a new destination, or name the directory the link points to (if it is empty)")
    )]
    DestinationLink { path: String },

    #[error("unknown dtype `{value}`")]
    #[diagnostic(code(mflow::ckpt::dtype_arg), help("use keep, float32, bfloat16 or float16"))]
    DtypeArg { value: String },

    #[error("unknown model source `{source_spec}`")]
    #[diagnostic(
        code(mflow::ckpt::source),
        help("use hf://ORG/NAME[@REV], path:DIR or init:PRESET (presets: {presets})")
    )]
    Source { source_spec: String, presets: String },

    #[error("{file}: {over}")]
    #[diagnostic(
        code(mflow::ckpt::memory),
        help(
            "a model or tokenizer of this size is far beyond any real one, so the file is likely corrupt or hostile; \
             if it is what you meant, set MFLOW_MEMORY_BUDGET to what this machine can hold (e.g. \
             MFLOW_MEMORY_BUDGET=64GiB; a stage's `env` table passes it to that stage)"
        )
    )]
    OverBudget { file: String, over: Box<mflow_untrusted::budget::OverBudget> },

    #[error("MFLOW_MEMORY_BUDGET = {} is not an amount of memory", excerpt(&format!("{value:?}")))]
    #[diagnostic(
        code(mflow::ckpt::memory_budget),
        help("set it to a number of bytes, with a unit if you like (512MiB, 64GiB), or unset it for half of this machine's memory")
    )]
    BudgetSetting { value: String },

    #[error("tokenizer: {reason}")]
    #[diagnostic(code(mflow::ckpt::tokenizer), help("this is a bug in the built-in tokenizer training; report it"))]
    Tokenizer { reason: String },
}

impl From<mflow_untrusted::budget::BadSetting> for CkptError {
    fn from(e: mflow_untrusted::budget::BadSetting) -> CkptError {
        CkptError::BudgetSetting { value: e.value }
    }
}

pub fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> CkptError + '_ {
    move |source| CkptError::Io { path: path.display().to_string(), source }
}
