//! `export`: shards back to an HF model directory, verified against the shards (the exported
//! model's logits and greedy generations, with transformers).

use mflow_contract::workload::VerifyExportConfig;
use serde::{Deserialize, Serialize};

use super::job::{JobContext, JobPlan};
use crate::spec::schema::{def, req, Field, Ty, COUNT};

pub const DOC: &str = "shards -> HF directory, verified against the shards";

pub const FIELDS: &[Field] = &[
    req("model", Ty::Str, "shards to export"),
    def("verify", Ty::Bool, "true", "load the result with transformers and compare with the shards"),
    def("prompts", Ty::StrList, "[\"The\"]", "prompts whose greedy generations must match"),
    def("max_new_tokens", COUNT, "16", "tokens generated per prompt"),
];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Params {
    pub model: String,
    pub verify: bool,
    pub prompts: Vec<String>,
    pub max_new_tokens: i64,
}

impl Params {
    pub fn job(&self, cx: &JobContext<'_>) -> Result<JobPlan, String> {
        let shards = cx.resolve(&self.model);
        let mut steps = vec![vec![cx.mflow()?, "export".into(), shards.clone(), cx.output()]];
        if self.verify {
            let config = VerifyExportConfig {
                stage: Default::default(),
                hf: cx.output(),
                shards,
                prompts: self.prompts.iter().map(|p| cx.resolve(p)).collect(),
                max_new_tokens: self.max_new_tokens.max(0) as u64,
                output: cx.output(),
            };
            let config = cx.write_config("verify-config", &config)?;
            steps.push(vec![cx.python()?, "-m".into(), "mflow_workloads.verify_export".into(), config]);
        }
        Ok(cx.plan(steps, true))
    }
}
