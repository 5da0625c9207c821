//! Checks that need more than one stage: parallel layouts against model shapes, and training
//! against the shards it reads. They run before anything starts.

use serde_json::Value as Json;

use super::PlanError;
use crate::spec::{pieces, Piece, StageSpec};
use crate::stages::Kind;

/// The stage whose output a parameter names, when it is exactly `${stages.X.output}`.
fn source<'a>(st: &StageSpec, key: &str, all: &'a [StageSpec]) -> Option<&'a StageSpec> {
    let v = st.params.get(key)?.as_str()?;
    match pieces(v).ok()?.as_slice() {
        [Piece::StageOutput(n)] => all.iter().find(|s| &s.name == n),
        _ => None,
    }
}

fn int(st: &StageSpec, key: &str) -> u32 {
    st.params.get(key).and_then(Json::as_u64).unwrap_or(1) as u32
}

fn invalid(stage: &str, message: String, help: &str) -> PlanError {
    PlanError::Invalid { stage: stage.to_string(), message, help: help.to_string() }
}

pub fn check(all: &[StageSpec]) -> Result<(), PlanError> {
    for st in all {
        match st.kind {
            Kind::Convert => {
                let Some(model) = source(st, "model", all) else { continue };
                let Some(preset) = model.params.get("source").and_then(Json::as_str).and_then(|s| s.strip_prefix("init:")) else { continue };
                if let Some(shape) = mflow_ckpt::preset_shape(preset) {
                    mflow_ckpt::check_parallelism(&shape, int(st, "tp"), int(st, "pp"))
                        .map_err(|e| invalid(&st.name, format!("tp={} pp={} does not fit preset `{preset}`: {e}", int(st, "tp"), int(st, "pp")), "choose tp dividing the heads, KV groups and FFN, and pp dividing the layers"))?;
                }
            }
            Kind::Train => {
                let Some(shards) = source(st, "model", all) else { continue };
                if matches!(shards.kind, Kind::Convert | Kind::Train) {
                    let (tp, pp) = (int(shards, "tp"), int(shards, "pp"));
                    if (tp, pp) != (int(st, "tp"), int(st, "pp")) {
                        return Err(invalid(
                            &st.name,
                            format!("trains at tp={} pp={}, but the shards from `{}` are tp={tp} pp={pp}", int(st, "tp"), int(st, "pp"), shards.name),
                            "set the same tp and pp on both stages, or convert again to the layout you train with",
                        ));
                    }
                }
                if let Some(data) = source(st, "data", all) {
                    if data.kind != Kind::Dataset && data.kind != Kind::Command {
                        return Err(invalid(&st.name, format!("`data` names `{}`, a {} stage, not a dataset", data.name, data.kind.name()), "point `data` at a dataset stage's output"));
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}
