//! `train`: tensor-, pipeline- and data-parallel training under torchrun: Megatron-Core on CUDA,
//! the reference engine (the same layout as gloo ranks) on CPU.

use mflow_contract::workload::{Attention, LrDecay, Precision, TrainConfig};
use serde::{Deserialize, Serialize};

use super::engine::Requested;
use super::job::{JobContext, JobPlan};
use super::Check;
use crate::spec::schema::{def, req, Field, Ty, NATURAL, NON_NEGATIVE};

pub const DOC: &str = "tensor/pipeline-parallel training (Megatron-Core on CUDA, reference engine on CPU)";

const ENGINE: Ty = Ty::Enum(&["auto", "reference", "megatron"]);

pub const FIELDS: &[Field] = &[
    req("model", Ty::Str, "shards from a convert stage"),
    req("data", Ty::Str, "a dataset stage's output"),
    def(
        "engine",
        ENGINE,
        "\"auto\"",
        "auto: megatron when the visible GPUs cover the ranks (one each), else reference (CPU)",
    ),
    def("tp", Ty::Int, "1", "tensor-parallel size; a reshard is inserted when the shards differ"),
    def("pp", Ty::Int, "1", "pipeline-parallel size; a reshard is inserted when the shards differ"),
    def("dp", Ty::Int, "1", "data-parallel size"),
    def("iterations", Ty::Int, "100", "optimizer steps"),
    def("seq_length", Ty::Int, "128", "tokens per sample"),
    def("micro_batch_size", Ty::Int, "4", "samples per micro-batch per rank"),
    def("global_batch_size", Ty::Int, "8", "samples per optimizer step"),
    def("lr", NON_NEGATIVE, "0.003", "peak learning rate"),
    def("min_lr", NON_NEGATIVE, "0.0003", "final learning rate, at most lr"),
    def("warmup_iterations", NATURAL, "10", "linear warmup"),
    def("lr_decay", Ty::Enum(&["cosine", "linear", "constant"]), "\"cosine\"", "decay after warmup"),
    def("weight_decay", NON_NEGATIVE, "0.1", "AdamW weight decay"),
    def("adam_beta1", Ty::FloatIn(0.0, 1.0), "0.9", "AdamW beta1"),
    def("adam_beta2", Ty::FloatIn(0.0, 1.0), "0.95", "AdamW beta2"),
    def("clip_grad", NON_NEGATIVE, "1.0", "gradient-norm clipping; 0 turns it off"),
    def("seed", Ty::IntIn(0, (1 << 31) - 1), "1234", "seed of data order and dropout"),
    def("precision", Ty::Enum(&["auto", "bf16", "fp32"]), "\"auto\"", "bf16 with megatron, fp32 with reference"),
    def("save_interval", Ty::Int, "25", "checkpoint every N iterations"),
    def("log_interval", Ty::Int, "1", "metrics every N iterations"),
    def("eval_interval", Ty::Int, "25", "validation loss every N iterations"),
    def("eval_iters", Ty::Int, "4", "validation batches per evaluation"),
    def("attention", Ty::Enum(&["sdpa", "local"]), "\"sdpa\"", "core attention implementation"),
];

/// `precision` as the spec gives it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RequestedPrecision {
    #[default]
    Auto,
    Bf16,
    Fp32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Params {
    pub model: String,
    pub data: String,
    pub engine: Requested,
    pub tp: i64,
    pub pp: i64,
    pub dp: i64,
    pub iterations: i64,
    pub seq_length: i64,
    pub micro_batch_size: i64,
    pub global_batch_size: i64,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_iterations: i64,
    pub lr_decay: LrDecay,
    pub weight_decay: f64,
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub clip_grad: f64,
    pub seed: i64,
    pub precision: RequestedPrecision,
    pub save_interval: i64,
    pub log_interval: i64,
    pub eval_interval: i64,
    pub eval_iters: i64,
    pub attention: Attention,
}

impl Params {
    pub fn layout(&self) -> (u64, u64) {
        (self.tp.max(1) as u64, self.pp.max(1) as u64)
    }

    pub fn world_size(&self) -> u64 {
        [self.tp, self.pp, self.dp].iter().map(|n| n.max(&1).unsigned_abs()).product()
    }

    pub fn check(&self, cx: &mut Check<'_>) {
        cx.positive(&[
            ("tp", self.tp),
            ("pp", self.pp),
            ("dp", self.dp),
            ("iterations", self.iterations),
            ("seq_length", self.seq_length),
            ("micro_batch_size", self.micro_batch_size),
            ("global_batch_size", self.global_batch_size),
            ("save_interval", self.save_interval),
            ("log_interval", self.log_interval),
            ("eval_interval", self.eval_interval),
            ("eval_iters", self.eval_iters),
        ]);
        if self.min_lr > self.lr {
            cx.invalid(
                "min_lr",
                format!("{} is above lr = {}", self.min_lr, self.lr),
                "the schedule decays from lr to min_lr: make min_lr at most lr",
            );
        }
        let (g, m, dp) = (self.global_batch_size, self.micro_batch_size, self.dp);
        if m > 0 && dp > 0 && g % (m * dp) != 0 {
            cx.invalid(
                "global_batch_size",
                format!("{g} is not divisible by micro_batch_size x dp = {}", m * dp),
                "make the global batch a multiple of micro_batch_size x dp",
            );
        }
        cx.ranks_split_over_nodes(self.world_size(), "tp x pp x dp");
    }

    /// The precision that runs: `auto` is bf16 with Megatron-Core and fp32 with the reference
    /// engine.
    pub fn precision_for(&self, engine: &str) -> Precision {
        match self.precision {
            RequestedPrecision::Bf16 => Precision::Bf16,
            RequestedPrecision::Fp32 => Precision::Fp32,
            RequestedPrecision::Auto if engine == "megatron" => Precision::Bf16,
            RequestedPrecision::Auto => Precision::Fp32,
        }
    }

    pub fn job(&self, cx: &JobContext<'_>) -> Result<JobPlan, String> {
        let engine = cx.engine()?;
        let u = |n: i64| n.max(0) as u64;
        let config = TrainConfig {
            stage: Default::default(),
            engine,
            shards: cx.resolve(&self.model),
            data: cx.resolve(&self.data),
            output: cx.output(),
            scratch: cx.scratch.display().to_string(),
            tp: u(self.tp) as u32,
            pp: u(self.pp) as u32,
            dp: u(self.dp) as u32,
            iterations: u(self.iterations),
            seq_length: u(self.seq_length),
            micro_batch_size: u(self.micro_batch_size),
            global_batch_size: u(self.global_batch_size),
            lr: self.lr,
            min_lr: self.min_lr,
            warmup_iterations: u(self.warmup_iterations),
            lr_decay: self.lr_decay,
            weight_decay: self.weight_decay,
            adam_beta1: self.adam_beta1,
            adam_beta2: self.adam_beta2,
            clip_grad: self.clip_grad,
            seed: self.seed,
            precision: self.precision_for(cx.engine_name()),
            save_interval: u(self.save_interval),
            log_interval: u(self.log_interval),
            eval_interval: u(self.eval_interval),
            eval_iters: u(self.eval_iters),
            attention: self.attention,
        };
        let config = cx.write_config("train-config", &config)?;
        cx.torchrun(self.world_size(), "mflow_workloads.train", &config)
    }
}
