//! Stage kinds: their parameters, their plan-time checks, and how each becomes a job.

pub mod fields;
mod job;

pub use job::{build_job, choose_engine, external_inputs, python_env, resolve_params, workload_digest, world_size, EngineChoice, JobContext, JobPlan};

use serde_json::{Map, Value as Json};

use crate::spec::error::{did_you_mean, Src, SpecError};
use crate::spec::schema::{invalid, Field};
use crate::spec::tree::Node;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Command,
    Model,
    Convert,
    Dataset,
    Train,
    Evaluate,
    Export,
}

impl Kind {
    pub const ALL: &'static [Kind] = &[Kind::Command, Kind::Model, Kind::Convert, Kind::Dataset, Kind::Train, Kind::Evaluate, Kind::Export];
    pub const NAMES: &'static [&'static str] = &["command", "model", "convert", "dataset", "train", "evaluate", "export"];

    pub fn parse(s: &str) -> Option<Kind> {
        Kind::NAMES.iter().position(|n| *n == s).map(|i| Kind::ALL[i])
    }

    pub fn name(self) -> &'static str {
        Kind::NAMES[Kind::ALL.iter().position(|k| *k == self).unwrap()]
    }

    pub fn doc(self) -> &'static str {
        match self {
            Kind::Command => "any command; writes under $MFLOW_OUTPUT",
            Kind::Model => "an HF model from the Hub, a directory, or a random-init preset",
            Kind::Convert => "HF -> Megatron shards for TP x PP, or reshard",
            Kind::Dataset => "text/JSONL -> Megatron indexed dataset",
            Kind::Train => "tensor/pipeline-parallel training (Megatron-Core on CUDA, reference engine on CPU)",
            Kind::Evaluate => "loss, perplexity, generation samples and gates",
            Kind::Export => "shards -> HF directory, verified against the shards",
        }
    }

    pub fn fields(self) -> &'static [Field] {
        match self {
            Kind::Command => fields::COMMAND,
            Kind::Model => fields::MODEL,
            Kind::Convert => fields::CONVERT,
            Kind::Dataset => fields::DATASET,
            Kind::Train => fields::TRAIN,
            Kind::Evaluate => fields::EVALUATE,
            Kind::Export => fields::EXPORT,
        }
    }

    /// Bumped whenever a kind's parameters or outputs change meaning; part of the cache key.
    pub fn version(self) -> u32 {
        1
    }

    /// Whether the stage runs the embedded Python workloads (their digest and the Python
    /// environment then enter the cache key).
    pub fn uses_python(self) -> bool {
        matches!(self, Kind::Train | Kind::Evaluate | Kind::Export)
    }

    /// The (tp, pp) layout of the shards a stage reads through `model`, when it reads shards.
    pub fn reads_shards(self, p: &Map<String, Json>) -> Option<(u64, u64)> {
        match self {
            Kind::Train => Some((layout_size(p, "tp"), layout_size(p, "pp"))),
            // Evaluation runs the whole depth on each rank.
            Kind::Evaluate => Some((layout_size(p, "tp"), 1)),
            _ => None,
        }
    }

    /// The (tp, pp) layout of the shards a stage writes, when its output is shards.
    pub fn writes_shards(self, p: &Map<String, Json>) -> Option<(u64, u64)> {
        match self {
            Kind::Convert | Kind::Train => Some((layout_size(p, "tp"), layout_size(p, "pp"))),
            _ => None,
        }
    }

    /// Plan-time checks beyond types.
    pub fn check(self, src: &Src, node: &Node, p: &Map<String, Json>, stages: &[&str], errors: &mut Vec<SpecError>) {
        let at = |key: &str| node.get(key).unwrap_or(node);
        let positive = |key: &str, errors: &mut Vec<SpecError>| {
            if let Some(n) = p.get(key).and_then(Json::as_i64) {
                if n < 1 {
                    errors.push(invalid(src, at(key), key, format!("must be at least 1, got {n}"), format!("set `{key}` to a positive integer")));
                }
            }
        };
        match self {
            Kind::Command => {
                if p.get("run").and_then(Json::as_array).is_some_and(Vec::is_empty) {
                    errors.push(invalid(src, at("run"), "run", "is empty", "give the program and its arguments, e.g. run = [\"python3\", \"step.py\"]"));
                }
            }
            Kind::Model => {
                let s = p.get("source").and_then(Json::as_str).unwrap_or_default();
                if !(s.starts_with("hf://") || s.starts_with("path:") || s.starts_with("init:")) {
                    errors.push(invalid(src, at("source"), "source", "unknown source scheme", "use hf://ORG/NAME[@REVISION], path:DIR or init:PRESET"));
                } else if let Some(preset) = s.strip_prefix("init:") {
                    let presets = mflow_ckpt::preset_names();
                    if !presets.contains(&preset) {
                        errors.push(invalid(src, at("source"), "source", format!("no preset `{preset}`"), did_you_mean(preset, presets, "presets")));
                    }
                }
            }
            Kind::Convert => {
                positive("tp", errors);
                positive("pp", errors);
            }
            Kind::Dataset => {
                if node.get("inputs").is_none() {
                    errors.push(SpecError::MissingKey {
                        src: src.clone(),
                        span: crate::spec::error::to_span(node.span().map(|r| r.start..r.start + 1)),
                        key: "inputs".into(),
                        table: "this dataset stage".into(),
                        help: "add `inputs = [\"corpus/*.jsonl\"]`: the text or JSONL files to tokenize".into(),
                    });
                }
                let s = p.get("splits").and_then(Json::as_str).unwrap_or_default();
                let parts: Vec<Option<f64>> = s.split(',').map(|x| x.trim().parse::<f64>().ok().filter(|v| *v >= 0.0)).collect();
                if parts.len() != 3 || parts.iter().any(Option::is_none) || parts.iter().flatten().sum::<f64>() <= 0.0 {
                    errors.push(invalid(src, at("splits"), "splits", "expected three non-negative ratios", "write train,valid,test ratios, e.g. \"98,1,1\""));
                }
            }
            Kind::Train => {
                for k in ["tp", "pp", "dp", "iterations", "seq_length", "micro_batch_size", "global_batch_size", "save_interval", "log_interval", "eval_interval", "eval_iters"] {
                    positive(k, errors);
                }
                let g = p.get("global_batch_size").and_then(Json::as_i64).unwrap_or(1);
                let m = p.get("micro_batch_size").and_then(Json::as_i64).unwrap_or(1);
                let dp = p.get("dp").and_then(Json::as_i64).unwrap_or(1);
                if m > 0 && dp > 0 && g % (m * dp) != 0 {
                    errors.push(invalid(src, at("global_batch_size"), "global_batch_size", format!("{g} is not divisible by micro_batch_size x dp = {}", m * dp), "make the global batch a multiple of micro_batch_size x dp"));
                }
                check_nodes(self, src, node, p, errors);
            }
            Kind::Evaluate => {
                for k in ["tp", "seq_length", "micro_batch_size", "eval_iters"] {
                    positive(k, errors);
                }
                check_nodes(self, src, node, p, errors);
                if let Some(b) = p.get("baseline").and_then(Json::as_str) {
                    if !stages.contains(&b) {
                        errors.push(invalid(src, at("baseline"), "baseline", format!("no stage named `{b}`"), did_you_mean(b, stages, "stages")));
                    }
                }
            }
            Kind::Export => {}
        }
    }
}

fn layout_size(p: &Map<String, Json>, key: &str) -> u64 {
    p.get(key).and_then(Json::as_u64).unwrap_or(1)
}

/// A distributed stage on several nodes runs the same number of ranks on each of them.
fn check_nodes(kind: Kind, src: &Src, node: &Node, p: &Map<String, Json>, errors: &mut Vec<SpecError>) {
    let nodes = p.get("nodes").and_then(Json::as_i64).unwrap_or(1);
    let world = world_size(kind, p);
    if nodes > 1 && world > 0 && !world.is_multiple_of(nodes as u64) {
        let sizes = if kind == Kind::Train { "tp x pp x dp" } else { "tp" };
        errors.push(invalid(
            src,
            node.get("nodes").unwrap_or(node),
            "nodes",
            format!("{world} ranks ({sizes}) do not split evenly over {nodes} nodes"),
            format!("choose a number of nodes that divides {world}, or change {sizes} to a multiple of {nodes}"),
        ));
    }
}
