//! Checks that need more than one stage, after reshards are inserted. They run before anything
//! starts.

use super::layout::named_by;
use super::PlanError;
use crate::spec::StageSpec;
use crate::stages::Kind;

fn invalid(stage: &str, message: String, help: &str) -> PlanError {
    PlanError::Invalid { stage: stage.to_string(), message, help: help.to_string() }
}

pub fn check(all: &[StageSpec]) -> Result<(), PlanError> {
    // Layouts were checked against the model before reshards were inserted (`layout`), and a
    // stage reading shards of another layout now reads them through a reshard.
    for st in all {
        let crate::stages::Params::Train(train) = &st.typed else { continue };
        if let Some(data) = named_by(&train.data, all) {
            if data.kind != Kind::Dataset && data.kind != Kind::Command {
                return Err(invalid(
                    &st.name,
                    format!("`data` names `{}`, a {} stage, not a dataset", data.name, data.kind.name()),
                    "point `data` at a dataset stage's output",
                ));
            }
        }
    }
    Ok(())
}
