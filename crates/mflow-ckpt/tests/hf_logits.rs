//! Converted shards must compute the same logits as the original model in transformers.
//!
//! Needs `MFLOW_PYTHON`: a Python with torch, transformers and safetensors.

use std::path::{Path, PathBuf};
use std::process::Command;

use mflow_ckpt::convert::convert;
use mflow_ckpt::presets::{self, Preset};
use mflow_ckpt::ModelShape;

fn python() -> String {
    std::env::var("MFLOW_PYTHON").unwrap_or_else(|_| {
        panic!("MFLOW_PYTHON is not set: point it at a Python with torch, transformers and safetensors to run the logits tests")
    })
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/megatron_forward.py")
}

fn run(args: &[&Path]) -> serde_json::Value {
    let out = Command::new(python()).arg(script()).args(args).output().expect("run MFLOW_PYTHON");
    assert!(out.status.success(), "python failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().expect("one JSON line")).expect("JSON")
}

fn check(preset: &Preset, layouts: &[(u32, u32)]) {
    let tmp = tempfile::tempdir().unwrap();
    let (init, hf) = (tmp.path().join("init"), tmp.path().join("hf"));
    presets::write(preset, &init, 11).unwrap();
    // transformers must load the preset and its tokenizer; the perturbed copy it saves is what
    // we convert, so norms and biases carry information.
    let p = run(&[Path::new("perturb"), &init, &hf]);
    assert!(p["tokenizer_ids"].as_array().unwrap().len() > 1, "{p}");
    for &(tp, pp) in layouts {
        let shards = tmp.path().join(format!("tp{tp}pp{pp}"));
        convert(&hf, &shards, tp, pp, None).unwrap();
        let r = run(&[Path::new("compare"), &hf, &shards]);
        let diff = r["max_abs_diff"].as_f64().unwrap();
        assert!(diff <= 1e-4, "tp={tp} pp={pp}: max |diff| {diff} > 1e-4: {r}");
        assert!(r["cosine"].as_f64().unwrap() > 0.99999, "{r}");
        // The comparison can fail: a wrong QKV reading is far off. (With one KV group per rank
        // the wrong reading coincides with the right one, so there is nothing to control.)
        if preset.shape.num_query_groups / tp as u64 > 1 {
            assert!(r["control_max_abs_diff"].as_f64().unwrap() > 100.0 * 1e-4, "{r}");
        }
        eprintln!("{:?} tp={tp} pp={pp}: {r}", preset.shape.architecture);
    }
}

#[test]
fn llama_tiny_tp2_logits_match_transformers() {
    check(&presets::preset("llama-tiny").unwrap(), &[(2, 1), (2, 2)]);
}

#[test]
fn qwen2_tiny_tp2_logits_match_transformers() {
    check(&presets::preset("qwen2-tiny").unwrap(), &[(2, 1), (2, 2)]);
}

#[test]
fn gpt2_tiny_tp2_logits_match_transformers() {
    check(&presets::preset("gpt2-tiny").unwrap(), &[(2, 1), (2, 2)]);
}

#[test]
fn llama_1b_shape_reduced_tp2_logits_match_transformers() {
    // Llama-3 rope scaling, GQA 4:1, tied; the perturbed copy is saved in float32.
    let full = presets::preset("llama-1b").unwrap();
    let p = Preset {
        shape: ModelShape {
            num_layers: 2,
            hidden_size: 256,
            num_attention_heads: 16,
            num_query_groups: 4,
            kv_channels: 16,
            ffn_hidden_size: 512,
            vocab_size: 1024,
            max_position_embeddings: 16384,
            ..full.shape
        },
        dtype: full.dtype,
    };
    check(&p, &[(2, 1), (4, 2)]);
}
