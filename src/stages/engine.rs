//! Which engine runs a train or evaluate stage: one rule for every backend. Megatron-Core runs
//! where the GPUs the stage's processes will see cover its ranks (one GPU per rank, NCCL), else
//! the reference engine, which runs any layout as gloo ranks on CPU. The GPUs a stage sees are
//! the backend's to say (`backend::stage_gpus`).

pub use mflow_contract::record::EngineChoice;
use serde::{Deserialize, Serialize};

/// `engine` as the spec gives it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Requested {
    #[default]
    Auto,
    Reference,
    Megatron,
}

/// The engine of a stage of `world` ranks (`sizes` names what multiplies to it: "tp x pp x
/// dp", "tp") whose processes see `gpus` GPUs. An explicit `megatron` that cannot run is an
/// error (message, help) at plan time rather than a crash in NCCL later.
pub fn choose(requested: Requested, world: u64, sizes: &str, gpus: usize) -> Result<EngineChoice, (String, String)> {
    let world = world as usize;
    let of = |n: usize| if n == 1 { "1 GPU".to_string() } else { format!("{n} GPUs") };
    let pick = |name: &str, reason: String| Ok(EngineChoice { name: name.into(), reason });
    match requested {
        Requested::Auto if gpus == 0 => pick("reference", "auto: no GPU visible".into()),
        Requested::Auto if world > gpus => {
            pick("reference", format!("auto: {sizes} = {world} needs {}, {gpus} visible", of(world)))
        }
        Requested::Auto => pick("megatron", format!("auto: {sizes} = {world} needs {}, {gpus} visible", of(world))),
        Requested::Megatron if gpus == 0 => Err((
            "engine = \"megatron\" needs CUDA, and no GPU is visible".into(),
            "run on a machine with GPUs, or set engine = \"reference\" (or \"auto\") to train on CPU".into(),
        )),
        Requested::Megatron if world > gpus => Err((
            format!("engine = \"megatron\" needs {} ({sizes} = {world}, one per rank), {gpus} visible", of(world)),
            format!(
                "lower {} until {sizes} is at most {gpus}, make more GPUs visible (resources.gpus x nodes on Kubernetes), or set engine = \"auto\" or \"reference\": the reference engine runs any layout on CPU",
                sizes.replace(" x ", "/")
            ),
        )),
        Requested::Megatron => pick("megatron", "set in the spec".into()),
        Requested::Reference => pick("reference", "set in the spec".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_runs_megatron_only_where_every_rank_has_a_gpu() {
        let on = |gpus| choose(Requested::Auto, 2, "tp x pp x dp", gpus).unwrap();
        assert_eq!(on(0), EngineChoice { name: "reference".into(), reason: "auto: no GPU visible".into() });
        // The one-GPU workstation: the reference engine runs the two ranks on CPU.
        assert_eq!(on(1).to_string(), "engine reference (auto: tp x pp x dp = 2 needs 2 GPUs, 1 visible)");
        assert_eq!(on(2).to_string(), "engine megatron (auto: tp x pp x dp = 2 needs 2 GPUs, 2 visible)");
        assert_eq!(on(8).name, "megatron");
        assert_eq!(
            choose(Requested::Auto, 8, "tp x pp x dp", 4).unwrap().reason,
            "auto: tp x pp x dp = 8 needs 8 GPUs, 4 visible"
        );
        assert_eq!(
            choose(Requested::Auto, 1, "tp", 1).unwrap().to_string(),
            "engine megatron (auto: tp = 1 needs 1 GPU, 1 visible)"
        );
        assert_eq!(choose(Requested::Auto, 2, "tp", 1).unwrap().name, "reference");
    }

    #[test]
    fn an_explicit_engine_is_kept_or_refused_with_what_to_do() {
        let megatron = |gpus| choose(Requested::Megatron, 2, "tp x pp x dp", gpus);
        assert_eq!(megatron(2).unwrap(), EngineChoice { name: "megatron".into(), reason: "set in the spec".into() });
        let (message, help) = megatron(1).unwrap_err();
        assert_eq!(message, "engine = \"megatron\" needs 2 GPUs (tp x pp x dp = 2, one per rank), 1 visible");
        assert!(help.contains("lower tp/pp/dp") && help.contains("engine = \"auto\" or \"reference\""), "{help}");
        assert!(megatron(0).unwrap_err().0.contains("no GPU is visible"));
        assert_eq!(choose(Requested::Reference, 2, "tp x pp x dp", 8).unwrap().name, "reference");
    }
}
