//! Parallel layouts against the model they split: tp must divide the attention heads, the KV
//! groups and the FFN, pp the layers. The model's shape comes from upstream (an `init:` preset,
//! or a `path:` model's config.json); where it is only known at run time (the Hub, a command's
//! output), the stage's own error reports it.

use std::path::Path;

use mflow_ckpt::ModelShape;
use serde_json::Value as Json;

use crate::spec::error::to_span;
use crate::spec::tree::{Node, Val};
use crate::spec::{pieces, Piece, Spec, SpecError, SpecErrors, StageSpec};
use crate::stages::Kind;

/// A config.json larger than this is not a model's config; the stage reports what it is.
const CONFIG_LIMIT: u64 = 1 << 20;

/// Every layout in the spec that cannot split its model, reported together with its place.
pub fn check(spec: &Spec, stages: &[StageSpec]) -> Result<(), SpecErrors> {
    let src = spec.src();
    // The checked spec keeps no spans: the text is read again, and only when needed.
    let mut root: Option<Option<Node>> = None;
    let mut errors = Vec::new();
    for st in stages {
        let (tp, pp) = match (st.typed.writes_shards(), st.typed.reads_shards()) {
            (Some((tp, pp)), _) => (tp, Some(pp)),
            // Evaluation reads its tp at full depth.
            (None, Some((tp, _))) => (tp, None),
            (None, None) => continue,
        };
        let Some((shape, from)) = model_shape(spec, st, stages) else { continue };
        let mut problems = Vec::new();
        if tp > 0 {
            let why = [
                ("attention heads", shape.num_attention_heads),
                ("KV groups (num_key_value_heads)", shape.num_query_groups),
                ("FFN size", shape.ffn_hidden_size),
            ]
            .into_iter()
            .find(|(_, n)| n % tp != 0)
            .map(|(what, n)| format!("does not divide the model's {n} {what}"));
            if let Some(why) = why {
                let fits = divisors(&[shape.num_attention_heads, shape.num_query_groups, shape.ffn_hidden_size]);
                problems.push(("tp", tp, why, format!("{from} splits at tp = {fits}")));
            }
        }
        if let Some(pp) = pp.filter(|&pp| pp > 0 && shape.num_layers % pp != 0) {
            let fits = divisors(&[shape.num_layers]);
            problems.push((
                "pp",
                pp,
                format!("does not divide the model's {} layers", shape.num_layers),
                format!("{from} splits at pp = {fits}"),
            ));
        }
        for (key, value, why, fits) in problems {
            let root = root.get_or_insert_with(|| crate::spec::tree::parse(&spec.source).ok()).as_ref();
            let (span, written) = place(root, st, key);
            let help = if written {
                fits
            } else {
                format!("{fits}; `{key} = {value}` is not in the file: it comes from --set or the default")
            };
            errors.push(SpecError::InvalidValue {
                src: src.clone(),
                span: to_span(span),
                key: format!("stages.{}.{key}", st.name),
                reason: format!("{key} = {value} {why}"),
                help,
            });
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(SpecErrors::new(&spec.path, errors))
    }
}

/// Valid sizes for a layout: the common divisors of `of`, listed up to a readable few.
fn divisors(of: &[u64]) -> String {
    let max = of.iter().copied().min().unwrap_or(1);
    let all: Vec<String> =
        (1..=max.min(4096)).filter(|d| of.iter().all(|n| n % d == 0)).map(|d| d.to_string()).collect();
    if all.len() > 8 {
        format!("{}, ... {}", all[..7].join(", "), all[all.len() - 1])
    } else {
        all.join(", ")
    }
}

/// Where a stage's `key` is written in the spec, and whether the file's value is the one that
/// applies (not replaced by `--set`, nor absent and defaulted). Otherwise, the stage's name.
fn place(root: Option<&Node>, st: &StageSpec, key: &str) -> (Option<std::ops::Range<usize>>, bool) {
    let Some(table) = root.and_then(|r| r.get("stages")) else { return (None, false) };
    let at_name = table.get_key(&st.name).and_then(|k| k.origin.span());
    match table.get(&st.name).and_then(|t| t.get(key)) {
        Some(n) => {
            let same = match &n.value {
                // A variable's value may come from --set vars.X: the reference is still the place.
                Val::Str(s) => s.contains("${") || st.params.get(key) == Some(&Json::String(s.clone())),
                v => st.params.get(key) == Some(&v.to_json()),
            };
            if same {
                (n.span(), true)
            } else {
                (at_name, false)
            }
        }
        None => (at_name, false),
    }
}

/// The shape of the model a stage reads, followed through the shards back to the model stage,
/// and a phrase naming where it comes from.
fn model_shape(spec: &Spec, st: &StageSpec, all: &[StageSpec]) -> Option<(ModelShape, String)> {
    let mut at = st;
    // Each step goes upstream, and the spec has no cycles; the bound is only a guard.
    for _ in 0..=all.len() {
        let up = upstream(at, all)?;
        match up.kind {
            Kind::Model => return model_stage_shape(spec, up),
            Kind::Convert | Kind::Train => at = up,
            _ => return None,
        }
    }
    None
}

fn model_stage_shape(spec: &Spec, st: &StageSpec) -> Option<(ModelShape, String)> {
    let crate::stages::Params::Model(m) = &st.typed else { return None };
    let source = m.source.as_str();
    if let Some(preset) = source.strip_prefix("init:") {
        return mflow_ckpt::preset_shape(preset).map(|s| (s, format!("preset `{preset}` (stage `{}`)", st.name)));
    }
    let dir = source.strip_prefix("path:")?;
    let file = spec.dir.join(dir).join("config.json");
    let shape = read_config(&file)?;
    Some((shape, format!("the model in `{dir}` (stage `{}`)", st.name)))
}

/// A `path:` model's config.json, read when it is small enough to be one. Anything unreadable
/// is left to the stage, which says what is wrong with it.
fn read_config(file: &Path) -> Option<ModelShape> {
    let config = crate::untrusted::read_json(file, CONFIG_LIMIT)?;
    mflow_ckpt::shape::from_hf_config(&file.display().to_string(), &config).ok()
}

/// The stage whose output a stage's `model` names, when it is exactly `${stages.X.output}`.
pub(super) fn upstream<'a>(st: &StageSpec, all: &'a [StageSpec]) -> Option<&'a StageSpec> {
    named_by(st.typed.model()?, all)
}

/// The stage whose output `v` is, when it is exactly `${stages.X.output}`.
pub(super) fn named_by<'a>(v: &str, all: &'a [StageSpec]) -> Option<&'a StageSpec> {
    match pieces(v).ok()?.as_slice() {
        [Piece::StageOutput(n)] => all.iter().find(|s| &s.name == n),
        _ => None,
    }
}
