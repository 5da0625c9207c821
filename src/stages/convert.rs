//! `convert`: HF safetensors to Megatron shards for tp x pp, or shards to another layout.

use serde::{Deserialize, Serialize};

use super::job::{JobContext, JobPlan};
use super::Check;
use crate::spec::schema::{def, req, Field, Ty};

pub const DOC: &str = "HF -> Megatron shards for TP x PP, or reshard";

pub const FIELDS: &[Field] = &[
    req("model", Ty::Str, "HF model or shards, usually \"${stages.NAME.output}\""),
    def("tp", Ty::Int, "1", "tensor-parallel size"),
    def("pp", Ty::Int, "1", "pipeline-parallel size"),
    def("dtype", Ty::Enum(&["keep", "float32", "bfloat16", "float16"]), "\"keep\"", "dtype of the shards"),
];

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Params {
    pub model: String,
    pub tp: i64,
    pub pp: i64,
    pub dtype: String,
}

impl Params {
    /// A reshard of `model` (an upstream's output) to `tp` x `pp`, as planning inserts one.
    pub fn reshard(model: String, tp: u64, pp: u64) -> Params {
        Params { model, tp: tp as i64, pp: pp as i64, dtype: "keep".into() }
    }

    pub fn check(&self, cx: &mut Check<'_>) {
        cx.positive(&[("tp", self.tp), ("pp", self.pp)]);
    }

    pub fn job(&self, cx: &JobContext<'_>) -> Result<JobPlan, String> {
        let mut argv = vec![cx.mflow()?, "convert".into(), cx.resolve(&self.model), cx.output()];
        argv.extend(["--tp".into(), self.tp.to_string(), "--pp".into(), self.pp.to_string()]);
        if self.dtype != "keep" {
            argv.extend(["--dtype".into(), self.dtype.clone()]);
        }
        Ok(cx.plan(vec![argv], true))
    }
}
