//! The stage <-> workload protocol: the JSON configs mflow writes for the Python workloads
//! (`python -m mflow_workloads.train CONFIG`, ...), and the files a stage writes about itself
//! (`MFLOW_STATUS`, `MFLOW_PROGRESS`). The configs' JSON Schemas are generated from these types
//! (workloads/schemas/, held equal by a test), and the workloads validate against them.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::FailureClass;

/// Which engine runs a train or evaluate stage: the engine choice made at plan time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    Reference,
    Megatron,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    Bf16,
    Fp32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum LrDecay {
    Cosine,
    Linear,
    Constant,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Attention {
    Sdpa,
    Local,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    Train,
    Valid,
    Test,
}

/// The `stage` of a config: which workload it is for (one value each).
macro_rules! stage_tag {
    ($name:ident, $value:literal) => {
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
        pub enum $name {
            #[default]
            #[serde(rename = $value)]
            Only,
        }
    };
}
stage_tag!(TrainStage, "train");
stage_tag!(EvaluateStage, "evaluate");
stage_tag!(VerifyExportStage, "verify_export");

/// `python -m mflow_workloads.train CONFIG`: train shards on a dataset, tp x pp x dp ranks
/// under torchrun.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(title = "train")]
pub struct TrainConfig {
    pub stage: TrainStage,
    pub engine: Engine,
    /// The shards to start from (absolute).
    pub shards: String,
    /// The dataset stage's output (absolute).
    pub data: String,
    /// Where the trained shards go (absolute).
    pub output: String,
    /// Checkpoints that survive a failed attempt (absolute).
    pub scratch: String,
    #[schemars(range(min = 1))]
    pub tp: u32,
    #[schemars(range(min = 1))]
    pub pp: u32,
    #[schemars(range(min = 1))]
    pub dp: u32,
    #[schemars(range(min = 1))]
    pub iterations: u64,
    #[schemars(range(min = 1))]
    pub seq_length: u64,
    #[schemars(range(min = 1))]
    pub micro_batch_size: u64,
    #[schemars(range(min = 1))]
    pub global_batch_size: u64,
    #[schemars(range(min = 0.0))]
    pub lr: f64,
    #[schemars(range(min = 0.0))]
    pub min_lr: f64,
    pub warmup_iterations: u64,
    pub lr_decay: LrDecay,
    #[schemars(range(min = 0.0))]
    pub weight_decay: f64,
    #[schemars(range(min = 0.0))]
    pub adam_beta1: f64,
    #[schemars(range(min = 0.0))]
    pub adam_beta2: f64,
    #[schemars(range(min = 0.0))]
    pub clip_grad: f64,
    pub seed: i64,
    pub precision: Precision,
    #[schemars(range(min = 1))]
    pub save_interval: u64,
    #[schemars(range(min = 1))]
    pub log_interval: u64,
    #[schemars(range(min = 1))]
    pub eval_interval: u64,
    #[schemars(range(min = 1))]
    pub eval_iters: u64,
    pub attention: Attention,
}

/// `python -m mflow_workloads.evaluate CONFIG`: losses, perplexities and samples of shards
/// (and of a baseline HF model) on a dataset's splits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(title = "evaluate")]
pub struct EvaluateConfig {
    pub stage: EvaluateStage,
    pub engine: Engine,
    pub shards: String,
    pub data: String,
    pub output: String,
    #[schemars(range(min = 1))]
    pub tp: u32,
    /// Evaluation runs the whole depth on each rank.
    #[schemars(range(min = 1, max = 1))]
    pub pp: u32,
    #[schemars(range(min = 1))]
    pub seq_length: u64,
    #[schemars(range(min = 1))]
    pub micro_batch_size: u64,
    #[schemars(range(min = 1))]
    pub eval_iters: u64,
    pub splits: Vec<Split>,
    /// An HF model directory evaluated on the same data (absolute), or null.
    #[schemars(required, extend("type" = ["string", "null"]))]
    pub baseline: Option<String>,
    pub prompts: Vec<String>,
    pub max_new_tokens: u64,
    pub precision: Precision,
}

/// `python -m mflow_workloads.verify_export CONFIG`: the exported HF model against the shards.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(title = "verify_export")]
pub struct VerifyExportConfig {
    pub stage: VerifyExportStage,
    /// The exported HF model (absolute).
    pub hf: String,
    pub shards: String,
    #[schemars(length(min = 1))]
    pub prompts: Vec<String>,
    #[schemars(range(min = 1))]
    pub max_new_tokens: u64,
    pub output: String,
}

/// The JSON Schemas of the configs, by the file name they are kept under.
pub fn schemas() -> Vec<(&'static str, serde_json::Value)> {
    let json = |s: schemars::Schema| serde_json::to_value(s).expect("a schema serializes");
    vec![
        ("train.schema.json", json(schemars::schema_for!(TrainConfig))),
        ("evaluate.schema.json", json(schemars::schema_for!(EvaluateConfig))),
        ("verify_export.schema.json", json(schemars::schema_for!(VerifyExportConfig))),
    ]
}

/// What a stage may write to `MFLOW_STATUS` about itself (one JSON object, rewritten whole):
/// the class of its own failure, and its checkpoints.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<FailureClass>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The newest complete checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_iteration: Option<u64>,
    /// The checkpoint this attempt started from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from: Option<u64>,
}

/// One line a stage appends to `MFLOW_PROGRESS`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// What is being counted ("convert", "tokenize", "train").
    #[serde(default)]
    pub label: String,
    pub done: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total: Option<u64>,
    /// "bytes", "tokens", "it", "files", ...
    #[serde(default)]
    pub unit: String,
    /// A short free-text status, e.g. "loss 3.21".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl Progress {
    /// Parses one line; `None` for anything that is not an event, so that a stage writing
    /// garbage never disturbs the run.
    pub fn parse(line: &str) -> Option<Progress> {
        serde_json::from_str(line.trim()).ok()
    }
}
