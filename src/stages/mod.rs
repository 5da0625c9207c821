//! Stage kinds, one file each: its parameters as a struct (deserialized once, when the spec is
//! checked), its field table, its plan-time checks, the layouts it reads and writes, and how it
//! becomes a job. [`Params`] is the one place that dispatches on the kind.

pub mod command;
pub mod convert;
pub mod dataset;
pub mod engine;
pub mod evaluate;
pub mod export;
pub mod fields;
mod job;
pub mod model;
pub mod train;

pub use engine::EngineChoice;
pub use job::{build_job, python_env, workload_digest, JobContext, JobPlan};

use std::path::Path;

use serde_json::{Map, Value as Json};

use crate::spec::error::{SpecError, Src};
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
    pub const ALL: &'static [Kind] =
        &[Kind::Command, Kind::Model, Kind::Convert, Kind::Dataset, Kind::Train, Kind::Evaluate, Kind::Export];
    pub const NAMES: &'static [&'static str] =
        &["command", "model", "convert", "dataset", "train", "evaluate", "export"];

    pub fn parse(s: &str) -> Option<Kind> {
        Kind::NAMES.iter().position(|n| *n == s).map(|i| Kind::ALL[i])
    }

    pub fn name(self) -> &'static str {
        Kind::NAMES[Kind::ALL.iter().position(|k| *k == self).unwrap()]
    }

    pub fn doc(self) -> &'static str {
        match self {
            Kind::Command => command::DOC,
            Kind::Model => model::DOC,
            Kind::Convert => convert::DOC,
            Kind::Dataset => dataset::DOC,
            Kind::Train => train::DOC,
            Kind::Evaluate => evaluate::DOC,
            Kind::Export => export::DOC,
        }
    }

    pub fn fields(self) -> &'static [Field] {
        match self {
            Kind::Command => command::FIELDS,
            Kind::Model => model::FIELDS,
            Kind::Convert => convert::FIELDS,
            Kind::Dataset => dataset::FIELDS,
            Kind::Train => train::FIELDS,
            Kind::Evaluate => evaluate::FIELDS,
            Kind::Export => export::FIELDS,
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

    /// Whether the stage runs torchrun ranks (on Kubernetes: the torch runtime and its image).
    pub fn is_distributed(self) -> bool {
        matches!(self, Kind::Train | Kind::Evaluate)
    }
}

/// A stage's parameters, typed by its kind.
#[derive(Debug, Clone, PartialEq)]
pub enum Params {
    Command(command::Params),
    Model(model::Params),
    Convert(convert::Params),
    Dataset(dataset::Params),
    Train(train::Params),
    Evaluate(evaluate::Params),
    Export(export::Params),
}

impl Default for Params {
    fn default() -> Self {
        Params::Command(command::Params::default())
    }
}

/// What a kind's plan-time checks report against.
pub struct Check<'a> {
    pub src: &'a Src,
    /// The stage's table in the spec.
    pub node: &'a Node,
    /// The names of every stage of the spec.
    pub stages: &'a [&'a str],
    /// `nodes` of the stage.
    pub nodes: u64,
    pub errors: &'a mut Vec<SpecError>,
}

impl Check<'_> {
    /// Reports `key` (at its place in the table, else at the table).
    pub fn invalid(&mut self, key: &str, reason: impl Into<String>, help: impl Into<String>) {
        let at = self.node.get(key).unwrap_or(self.node);
        self.errors.push(invalid(self.src, at, key, reason, help));
    }

    /// Reports each of `values` below 1.
    pub fn positive(&mut self, values: &[(&str, i64)]) {
        for &(key, n) in values {
            if n < 1 {
                self.invalid(key, format!("must be at least 1, got {n}"), format!("set `{key}` to a positive integer"));
            }
        }
    }

    /// A distributed stage on several nodes runs the same number of ranks on each of them.
    pub fn ranks_split_over_nodes(&mut self, world: u64, sizes: &str) {
        let nodes = self.nodes;
        if nodes > 1 && world > 0 && !world.is_multiple_of(nodes) {
            self.invalid(
                "nodes",
                format!("{world} ranks ({sizes}) do not split evenly over {nodes} nodes"),
                format!("choose a number of nodes that divides {world}, or change {sizes} to a multiple of {nodes}"),
            );
        }
    }
}

impl Params {
    /// The parameters of a stage of `kind` from its checked table (defaults filled): the types
    /// are the field table's, so this fails only where the table and the struct disagree.
    pub fn of(kind: Kind, table: &Map<String, Json>) -> Result<Params, String> {
        let v = Json::Object(table.clone());
        let typed = match kind {
            Kind::Command => serde_json::from_value(v).map(Params::Command),
            Kind::Model => serde_json::from_value(v).map(Params::Model),
            Kind::Convert => serde_json::from_value(v).map(Params::Convert),
            Kind::Dataset => serde_json::from_value(v).map(Params::Dataset),
            Kind::Train => serde_json::from_value(v).map(Params::Train),
            Kind::Evaluate => serde_json::from_value(v).map(Params::Evaluate),
            Kind::Export => serde_json::from_value(v).map(Params::Export),
        };
        typed.map_err(|e| format!("the parameters of a {} stage: {e}", kind.name()))
    }

    /// Plan-time checks beyond types.
    pub fn check(&self, cx: &mut Check<'_>) {
        // A native stage is one process writing one output directory: a second node would run
        // it again, into the same directory.
        let native = match self {
            Params::Model(_) => Some(Kind::Model),
            Params::Convert(_) => Some(Kind::Convert),
            Params::Dataset(_) => Some(Kind::Dataset),
            Params::Export(_) => Some(Kind::Export),
            _ => None,
        };
        if let Some(kind) = native.filter(|_| cx.nodes > 1) {
            cx.invalid(
                "nodes",
                format!("a {} stage runs as one process on one node, not on {}", kind.name(), cx.nodes),
                "remove `nodes`: train and evaluate split their ranks over nodes, a command runs on each, the other kinds on one",
            );
        }
        match self {
            Params::Command(p) => p.check(cx),
            Params::Model(p) => p.check(cx),
            Params::Convert(p) => p.check(cx),
            Params::Dataset(p) => p.check(cx),
            Params::Train(p) => p.check(cx),
            Params::Evaluate(p) => p.check(cx),
            Params::Export(_) => {}
        }
    }

    /// The `model` a stage reads (shards or an HF model), usually `${stages.NAME.output}`.
    pub fn model(&self) -> Option<&str> {
        match self {
            Params::Convert(p) => Some(&p.model),
            Params::Train(p) => Some(&p.model),
            Params::Evaluate(p) => Some(&p.model),
            Params::Export(p) => Some(&p.model),
            _ => None,
        }
    }

    /// Points the stage at another `model` (planning inserts reshards this way).
    pub fn set_model(&mut self, model: String) {
        match self {
            Params::Convert(p) => p.model = model,
            Params::Train(p) => p.model = model,
            Params::Evaluate(p) => p.model = model,
            Params::Export(p) => p.model = model,
            _ => {}
        }
    }

    /// The (tp, pp) layout of the shards a stage reads through `model`, when it reads shards.
    pub fn reads_shards(&self) -> Option<(u64, u64)> {
        match self {
            Params::Train(p) => Some(p.layout()),
            // Evaluation runs the whole depth on each rank.
            Params::Evaluate(p) => Some((p.tp.max(1) as u64, 1)),
            _ => None,
        }
    }

    /// The (tp, pp) layout of the shards a stage writes, when its output is shards.
    pub fn writes_shards(&self) -> Option<(u64, u64)> {
        match self {
            Params::Convert(p) => Some((p.tp.max(1) as u64, p.pp.max(1) as u64)),
            Params::Train(p) => Some(p.layout()),
            _ => None,
        }
    }

    /// The ranks of one job of the stage.
    pub fn world_size(&self) -> u64 {
        match self {
            Params::Train(p) => p.world_size(),
            Params::Evaluate(p) => p.tp.max(1) as u64,
            _ => 1,
        }
    }

    /// The engine of a stage whose processes see `gpus` GPUs, for the kinds that have one.
    pub fn engine(&self, gpus: usize) -> Result<Option<EngineChoice>, (String, String)> {
        match self {
            Params::Train(p) => engine::choose(p.engine, p.world_size(), "tp x pp x dp", gpus).map(Some),
            Params::Evaluate(p) => engine::choose(p.engine, p.tp.max(1) as u64, "tp", gpus).map(Some),
            // verify_export merges every rank in memory and runs the reference model in one
            // process on CPU: no layout needs a GPU, so there is nothing to choose.
            Params::Export(p) if p.verify => Ok(Some(EngineChoice {
                name: "reference".into(),
                reason: "the verification runs in one process on CPU, for any tp x pp".into(),
            })),
            _ => Ok(None),
        }
    }

    /// Files outside the DAG that the stage reads, relative to the spec (`spec_dir`), as input
    /// patterns: every parameter that names a path rather than an upstream output (whose digest
    /// is in the key already). They enter the key and are held to the project as `inputs` are.
    pub fn external_inputs(&self, spec_dir: &Path) -> Vec<String> {
        let files = match self {
            Params::Model(p) => p.local_dir().into_iter().collect(),
            Params::Dataset(p) => p.tokenizer_files(spec_dir),
            Params::Convert(p) => job::literal_path(&p.model).into_iter().collect(),
            Params::Export(p) => job::literal_path(&p.model).into_iter().collect(),
            Params::Train(p) => [&p.model, &p.data].into_iter().filter_map(|s| job::literal_path(s)).collect(),
            Params::Evaluate(p) => [&p.model, &p.data].into_iter().filter_map(|s| job::literal_path(s)).collect(),
            Params::Command(_) => Vec::new(),
        };
        // Literal paths: a `[` or `*` in a file name is not a pattern.
        files.iter().map(|p: &String| glob::Pattern::escape(p)).collect()
    }
}

/// Parameters as they enter the cache key: defaults filled, `auto` choices made (the engine
/// that runs, and the precision that follows from it); and the engine chosen, with why.
/// `gpus`: the GPUs the stage's processes will see (`crate::backend::stage_gpus`).
pub fn key_params(st: &crate::spec::StageSpec, gpus: usize) -> Result<(Json, Option<EngineChoice>), (String, String)> {
    let mut p = st.params.clone();
    if !st.env.is_empty() {
        // Environment variables shape the output as much as parameters do.
        p.insert("env".into(), serde_json::json!(st.env));
    }
    let choice = st.typed.engine(gpus)?;
    if let (Some(chosen), true) = (&choice, st.kind.is_distributed()) {
        if let Params::Train(t) = &st.typed {
            let precision = t.precision_for(&chosen.name);
            p.insert("precision".into(), serde_json::to_value(precision).expect("a precision serializes"));
        }
        // The engine that runs is part of the key, so that a Megatron result is never reused
        // for a reference run or the other way round.
        p.insert("engine".into(), Json::String(chosen.name.clone()));
    }
    Ok((Json::Object(p), choice))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A stage of `kind` with the field table's defaults and `set` over them.
    fn stage(kind: Kind, set: Json) -> crate::spec::StageSpec {
        let mut table = Map::new();
        for f in kind.fields() {
            if let Some(d) = f.default {
                table.insert(f.name.to_string(), serde_json::from_str(d).unwrap());
            } else if f.required && kind == Kind::Command {
                table.insert(f.name.to_string(), json!(["true"]));
            } else if f.required {
                table.insert(f.name.to_string(), json!("${stages.up.output}"));
            }
        }
        table.extend(set.as_object().unwrap().clone());
        crate::spec::StageSpec::test_stage("s", kind, table)
    }

    #[test]
    fn every_kind_reads_its_own_field_table() {
        for &kind in Kind::ALL {
            let st = stage(kind, json!({}));
            assert_eq!(
                std::mem::discriminant(&st.typed),
                std::mem::discriminant(&Params::of(kind, &st.params).unwrap())
            );
        }
    }

    /// The key covers the engine that runs, and only that: not the count of GPUs behind the
    /// choice.
    #[test]
    fn the_key_parameters_name_the_engine_that_runs() {
        let train = stage(Kind::Train, json!({"engine": "auto", "tp": 2, "precision": "auto"}));
        let on = |gpus| key_params(&train, gpus).unwrap();
        let ((none, _), (one, why), (two, _)) = (on(0), on(1), on(2));
        assert_eq!((one["engine"].as_str(), one["precision"].as_str()), (Some("reference"), Some("fp32")));
        assert_eq!((two["engine"].as_str(), two["precision"].as_str()), (Some("megatron"), Some("bf16")));
        assert_eq!(none, one, "a reference result is the same whatever GPUs were visible");
        assert_ne!(one, two);
        assert!(why.unwrap().reason.contains("1 visible"));
        let export = stage(Kind::Export, json!({"verify": true}));
        assert_eq!(key_params(&export, 0).unwrap().1.unwrap().name, "reference");
        assert_eq!(key_params(&stage(Kind::Export, json!({"verify": false})), 0).unwrap().1, None);
        assert_eq!(key_params(&stage(Kind::Convert, json!({"tp": 2})), 0).unwrap().1, None);
    }

    #[test]
    fn layouts_read_and_written_follow_the_parameters() {
        let train = stage(Kind::Train, json!({"tp": 2, "pp": 2, "dp": 3}));
        assert_eq!(train.typed.reads_shards(), Some((2, 2)));
        assert_eq!(train.typed.writes_shards(), Some((2, 2)));
        assert_eq!(train.typed.world_size(), 12);
        let eval = stage(Kind::Evaluate, json!({"tp": 4}));
        assert_eq!((eval.typed.reads_shards(), eval.typed.writes_shards()), (Some((4, 1)), None));
        assert_eq!(stage(Kind::Convert, json!({"tp": 2, "pp": 4})).typed.writes_shards(), Some((2, 4)));
    }
}
