//! `init:PRESET`: deterministic random-init Hugging Face checkpoints written from Rust.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use rayon::prelude::*;
use safetensors::Dtype;
use serde_json::{json, Value};

use crate::convert::write_json;
use crate::error::{io, CkptError};
use crate::hf::dtype_name;
use crate::layout::hf_tensors;
use crate::shape::{Architecture, ModelShape, VOCAB_DIVISOR};
use crate::st::{build_header, HeaderEntry};
use crate::tokenizer;
use crate::writer::Staging;

pub const NAMES: &[&str] = &["llama-tiny", "llama-1b", "qwen2-tiny", "gpt2-tiny"];

/// Elements generated per random stream; streams are seeded independently so they can be
/// generated in parallel and still give the same bytes.
const STREAM: usize = 1 << 20;
const INIT_STD: f32 = 0.02;

/// A model to initialise: its shape and the dtype its weights are stored in.
#[derive(Debug, Clone)]
pub struct Preset {
    pub shape: ModelShape,
    pub dtype: Dtype,
}

fn base(arch: Architecture) -> ModelShape {
    let llama = arch != Architecture::Gpt2;
    ModelShape {
        architecture: arch,
        num_layers: 4,
        hidden_size: 256,
        num_attention_heads: 8,
        num_query_groups: 4,
        kv_channels: 32,
        ffn_hidden_size: if llama { 688 } else { 1024 },
        gated_linear_unit: llama,
        activation: if llama { "silu" } else { "gelu_tanh" }.into(),
        normalization: if llama { "RMSNorm" } else { "LayerNorm" }.into(),
        layernorm_epsilon: 1e-5,
        add_bias_linear: !llama,
        add_qkv_bias: arch != Architecture::Llama,
        position_embedding_type: if llama { "rope" } else { "learned_absolute" }.into(),
        rotary_base: 10000.0,
        rotary_percent: 1.0,
        rope_scaling: false,
        rope_scaling_factor: 8.0,
        max_position_embeddings: if llama { 2048 } else { 1024 },
        vocab_size: tokenizer::VOCAB_SIZE,
        make_vocab_size_divisible_by: VOCAB_DIVISOR,
        share_embeddings_and_output_weights: true,
    }
}

pub fn preset(name: &str) -> Option<Preset> {
    let f32 = Dtype::F32;
    Some(match name {
        "llama-tiny" => Preset { shape: base(Architecture::Llama), dtype: f32 },
        "qwen2-tiny" => Preset {
            shape: ModelShape {
                ffn_hidden_size: 704,
                layernorm_epsilon: 1e-6,
                rotary_base: 1_000_000.0,
                share_embeddings_and_output_weights: false,
                ..base(Architecture::Qwen2)
            },
            dtype: f32,
        },
        "gpt2-tiny" => Preset { shape: ModelShape { num_query_groups: 8, ..base(Architecture::Gpt2) }, dtype: f32 },
        "llama-1b" => Preset {
            shape: ModelShape {
                num_layers: 16,
                hidden_size: 2048,
                num_attention_heads: 32,
                num_query_groups: 8,
                kv_channels: 64,
                ffn_hidden_size: 8192,
                rotary_base: 500_000.0,
                rope_scaling: true,
                rope_scaling_factor: 32.0,
                max_position_embeddings: 131072,
                vocab_size: 128256,
                ..base(Architecture::Llama)
            },
            dtype: Dtype::BF16,
        },
        _ => return None,
    })
}

pub fn shape(name: &str) -> Option<ModelShape> {
    preset(name).map(|p| p.shape)
}

/// The config.json transformers expects for the shape.
pub fn hf_config(p: &Preset) -> Value {
    let s = &p.shape;
    let eot = tokenizer::END_OF_TEXT_ID;
    let dtype = dtype_name(p.dtype);
    match s.architecture {
        Architecture::Gpt2 => json!({
            "architectures": ["GPT2LMHeadModel"],
            "activation_function": "gelu_new",
            "attn_pdrop": 0.0,
            "bos_token_id": eot,
            "dtype": dtype,
            "embd_pdrop": 0.0,
            "eos_token_id": eot,
            "initializer_range": INIT_STD,
            "layer_norm_epsilon": s.layernorm_epsilon,
            "model_type": "gpt2",
            "n_embd": s.hidden_size,
            "n_head": s.num_attention_heads,
            "n_inner": s.ffn_hidden_size,
            "n_layer": s.num_layers,
            "n_positions": s.max_position_embeddings,
            "resid_pdrop": 0.0,
            "scale_attn_weights": true,
            "tie_word_embeddings": s.share_embeddings_and_output_weights,
            "use_cache": true,
            "vocab_size": s.vocab_size,
        }),
        Architecture::Llama | Architecture::Qwen2 => {
            let rope = if s.rope_scaling {
                json!({"rope_type": "llama3", "rope_theta": s.rotary_base, "factor": s.rope_scaling_factor,
                       "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
            } else {
                json!({"rope_type": "default", "rope_theta": s.rotary_base})
            };
            let mut c = json!({
                "architectures": [if s.architecture == Architecture::Llama { "LlamaForCausalLM" } else { "Qwen2ForCausalLM" }],
                "attention_dropout": 0.0,
                "bos_token_id": eot,
                "dtype": dtype,
                "eos_token_id": eot,
                "hidden_act": "silu",
                "hidden_size": s.hidden_size,
                "initializer_range": INIT_STD,
                "intermediate_size": s.ffn_hidden_size,
                "max_position_embeddings": s.max_position_embeddings,
                "model_type": s.architecture.name(),
                "num_attention_heads": s.num_attention_heads,
                "num_hidden_layers": s.num_layers,
                "num_key_value_heads": s.num_query_groups,
                "rms_norm_eps": s.layernorm_epsilon,
                "rope_parameters": rope,
                "tie_word_embeddings": s.share_embeddings_and_output_weights,
                "use_cache": true,
                "vocab_size": s.vocab_size,
            });
            let obj = c.as_object_mut().expect("object");
            if s.architecture == Architecture::Llama {
                obj.insert("attention_bias".into(), json!(false));
                obj.insert("mlp_bias".into(), json!(false));
                obj.insert("head_dim".into(), json!(s.kv_channels));
                obj.insert("pretraining_tp".into(), json!(1));
            } else {
                obj.insert("use_sliding_window".into(), json!(false));
                obj.insert("sliding_window".into(), Value::Null);
                obj.insert("max_window_layers".into(), json!(s.num_layers));
                obj.insert("layer_types".into(), json!(vec!["full_attention"; s.num_layers as usize]));
            }
            c
        }
    }
}

/// How a tensor starts: HF's `_init_weights` (normal 0.02 for matrices, ones for norm scales,
/// zeros for biases; GPT-2 scales its residual projections by 1/sqrt(2 * layers)).
fn init_of(s: &ModelShape, name: &str) -> Option<f32> {
    let is_norm = name.contains("norm") || name.contains(".ln_");
    if name.ends_with(".bias") {
        return Some(0.0);
    }
    if is_norm {
        return Some(1.0);
    }
    let _ = s;
    None
}

fn std_of(s: &ModelShape, name: &str) -> f32 {
    if s.architecture == Architecture::Gpt2 && name.ends_with("c_proj.weight") {
        INIT_STD / ((2 * s.num_layers) as f32).sqrt()
    } else {
        INIT_STD
    }
}

/// Writes the preset as a Hugging Face model directory at `dst` (staged, then renamed).
pub fn write(p: &Preset, dst: &Path, seed: u64) -> Result<(), CkptError> {
    let staging = Staging::new(dst)?;
    let dir = staging.dir();
    tokenizer::write(dir, p.shape.max_position_embeddings)?;
    write_json(&dir.join("config.json"), &hf_config(p))?;
    let eot = tokenizer::END_OF_TEXT_ID;
    write_json(&dir.join("generation_config.json"), &json!({"bos_token_id": eot, "eos_token_id": eot}))?;
    write_weights(p, &dir.join("model.safetensors"), seed)?;
    staging.commit()
}

fn write_weights(p: &Preset, path: &Path, seed: u64) -> Result<(), CkptError> {
    let tensors = hf_tensors(&p.shape);
    let entries: Vec<HeaderEntry> =
        tensors.iter().map(|(n, s)| HeaderEntry { name: n, dtype: p.dtype, shape: s }).collect();
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let (header, _) = build_header(&entries, &meta);
    let total: u64 = tensors.iter().map(|(_, s)| s.iter().product::<u64>() * p.dtype.size() as u64).sum();
    let progress = mflow_progress::Reporter::new("init", Some(total), "bytes");
    let mut out = BufWriter::new(File::create(path).map_err(io(path))?);
    out.write_all(&header).map_err(io(path))?;
    for (name, shape) in &tensors {
        let n: usize = shape.iter().product::<u64>() as usize;
        let streams: Vec<usize> = (0..n.div_ceil(STREAM)).collect();
        // Generate a bounded batch of streams in parallel, then write them in order.
        for batch in streams.chunks(rayon::current_num_threads() * 4) {
            let parts: Vec<Vec<u8>> = batch
                .par_iter()
                .map(|&k| {
                    let len = STREAM.min(n - k * STREAM);
                    let values = match init_of(&p.shape, name) {
                        Some(c) => vec![c; len],
                        None => normal(seed, name, k, len, std_of(&p.shape, name)),
                    };
                    encode(&values, p.dtype)
                })
                .collect();
            for part in parts {
                out.write_all(&part).map_err(io(path))?;
                progress.inc(part.len() as u64);
            }
        }
    }
    out.flush().map_err(io(path))?;
    progress.finish();
    Ok(())
}

fn normal(seed: u64, name: &str, stream: usize, len: usize, std: f32) -> Vec<f32> {
    let mut h = blake3::Hasher::new();
    h.update(&seed.to_le_bytes());
    h.update(name.as_bytes());
    h.update(&(stream as u64).to_le_bytes());
    let mut rng = ChaCha8Rng::from_seed(*h.finalize().as_bytes());
    let dist = Normal::new(0.0f32, std).expect("positive std");
    (0..len).map(|_| dist.sample(&mut rng)).collect()
}

fn encode(values: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::BF16 => values.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect(),
        Dtype::F16 => values.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect(),
        _ => values.iter().flat_map(|&x| x.to_le_bytes()).collect(),
    }
}
