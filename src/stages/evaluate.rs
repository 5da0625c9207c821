//! `evaluate`: losses, perplexities and generation samples of shards (and of a baseline HF
//! model) on a dataset's splits, judged by the stage's gates.

use mflow_contract::workload::{EvaluateConfig, Precision, Split};
use serde::{Deserialize, Serialize};

use super::engine::Requested;
use super::job::{JobContext, JobPlan};
use super::Check;
use crate::spec::error::did_you_mean;
use crate::spec::schema::{def, opt, req, Field, Ty, NATURAL};

pub const DOC: &str = "loss, perplexity, generation samples and gates";

const ENGINE: Ty = Ty::Enum(&["auto", "reference", "megatron"]);

pub const FIELDS: &[Field] = &[
    req("model", Ty::Str, "shards to evaluate"),
    req("data", Ty::Str, "a dataset stage's output"),
    def(
        "engine",
        ENGINE,
        "\"auto\"",
        "auto: megatron when the visible GPUs cover the ranks (one each), else reference (CPU)",
    ),
    def("tp", Ty::Int, "1", "tensor-parallel size; a reshard is inserted when the shards differ"),
    def("seq_length", Ty::Int, "128", "tokens per sample"),
    def("micro_batch_size", Ty::Int, "4", "samples per batch"),
    def("eval_iters", Ty::Int, "8", "batches per split"),
    def("splits", Ty::StrList, "[\"valid\", \"test\"]", "dataset splits to evaluate"),
    opt("baseline", Ty::Str, "a stage whose output is an HF model to evaluate on the same data"),
    def("prompts", Ty::StrList, "[]", "prompts for greedy generation"),
    def("max_new_tokens", NATURAL, "32", "tokens generated per prompt"),
    def("precision", Ty::Enum(&["fp32", "bf16"]), "\"fp32\"", "evaluation precision"),
];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Params {
    pub model: String,
    pub data: String,
    pub engine: Requested,
    pub tp: i64,
    pub seq_length: i64,
    pub micro_batch_size: i64,
    pub eval_iters: i64,
    pub splits: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<String>,
    pub prompts: Vec<String>,
    pub max_new_tokens: i64,
    pub precision: Precision,
}

impl Params {
    pub fn check(&self, cx: &mut Check<'_>) {
        cx.positive(&[
            ("tp", self.tp),
            ("seq_length", self.seq_length),
            ("micro_batch_size", self.micro_batch_size),
            ("eval_iters", self.eval_iters),
        ]);
        cx.ranks_split_over_nodes(self.tp.max(1) as u64, "tp");
        for s in &self.splits {
            if split(s).is_none() {
                cx.invalid("splits", format!("no split `{s}`"), "use train, valid or test");
            }
        }
        if let Some(b) = &self.baseline {
            if !cx.stages.contains(&b.as_str()) {
                cx.invalid("baseline", format!("no stage named `{b}`"), did_you_mean(b, cx.stages, "stages"));
            }
        }
    }

    pub fn job(&self, cx: &JobContext<'_>) -> Result<JobPlan, String> {
        let engine = cx.engine()?;
        let u = |n: i64| n.max(0) as u64;
        let baseline = match &self.baseline {
            Some(b) => {
                Some(cx.upstream.get(b).ok_or(format!("baseline stage `{b}` has no output"))?.display().to_string())
            }
            None => None,
        };
        let config = EvaluateConfig {
            stage: Default::default(),
            engine,
            shards: cx.resolve(&self.model),
            data: cx.resolve(&self.data),
            output: cx.output(),
            tp: u(self.tp) as u32,
            pp: 1,
            seq_length: u(self.seq_length),
            micro_batch_size: u(self.micro_batch_size),
            eval_iters: u(self.eval_iters),
            splits: self.splits.iter().filter_map(|s| split(s)).collect(),
            baseline,
            prompts: self.prompts.iter().map(|p| cx.resolve(p)).collect(),
            max_new_tokens: u(self.max_new_tokens),
            precision: self.precision,
        };
        let config = cx.write_config("evaluate-config", &config)?;
        cx.torchrun(self.tp.max(1) as u64, "mflow_workloads.evaluate", &config)
    }
}

fn split(s: &str) -> Option<Split> {
    serde_json::from_value(serde_json::Value::String(s.to_string())).ok()
}
