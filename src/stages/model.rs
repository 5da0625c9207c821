//! `model`: an HF model from the Hub (`hf://ORG/NAME[@REV]`), a directory (`path:DIR`), or
//! random weights of a named shape (`init:PRESET`), written as an HF directory by mflow itself.

use serde::{Deserialize, Serialize};

use super::job::{literal_path, JobContext, JobPlan};
use super::Check;
use crate::spec::error::did_you_mean;
use crate::spec::schema::{def, req, Field, Ty, NATURAL};

pub const DOC: &str = "an HF model from the Hub, a directory, or a random-init preset";

pub const FIELDS: &[Field] = &[
    req("source", Ty::Str, "hf://ORG/NAME[@REV], path:DIR or init:PRESET"),
    def("seed", NATURAL, "0", "seed of init: presets"),
];

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Params {
    pub source: String,
    pub seed: i64,
}

impl Params {
    pub fn check(&self, cx: &mut Check<'_>) {
        let s = self.source.as_str();
        if !(s.starts_with("hf://") || s.starts_with("path:") || s.starts_with("init:")) {
            cx.invalid("source", "unknown source scheme", "use hf://ORG/NAME[@REVISION], path:DIR or init:PRESET");
        } else if let Some(preset) = s.strip_prefix("init:") {
            let presets = mflow_ckpt::preset_names();
            if !presets.contains(&preset) {
                cx.invalid("source", format!("no preset `{preset}`"), did_you_mean(preset, presets, "presets"));
            }
        }
    }

    /// The model directory a `path:` source names, when it is a path and not an upstream output.
    pub fn local_dir(&self) -> Option<String> {
        literal_path(self.source.strip_prefix("path:")?)
    }

    pub fn job(&self, cx: &JobContext<'_>) -> Result<JobPlan, String> {
        let src = match self.source.strip_prefix("path:") {
            Some(d) => format!("path:{}", cx.absolute(&cx.resolve(d))),
            None => cx.resolve(&self.source),
        };
        let argv = vec![cx.mflow()?, "model".into(), src, cx.output(), "--seed".into(), self.seed.to_string()];
        Ok(cx.plan(vec![argv], true))
    }
}
