//! The architecture-independent description of a model (Megatron's view of it), read from a
//! Hugging Face config.json, plus the parallelism rules that depend on it.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::CkptError;
use crate::untrusted::{excerpt, excerpt_of};

/// Megatron's default `make_vocab_size_divisible_by`.
pub const VOCAB_DIVISOR: u64 = 128;

/// Upper bounds on the sizes read from config.json and mflow-checkpoint.json, far above any
/// real model, so that a hostile number is refused before mflow plans (allocates) per layer,
/// per head or per vocabulary row, and products of sizes cannot overflow.
pub const MAX_LAYERS: u64 = 4096;
pub const MAX_HIDDEN: u64 = 1 << 20;
pub const MAX_HEADS: u64 = 1 << 14;
pub const MAX_KV_CHANNELS: u64 = 1 << 14;
pub const MAX_FFN: u64 = 1 << 22;
pub const MAX_VOCAB: u64 = 1 << 31;
pub const MAX_POSITIONS: u64 = 1 << 24;
pub const MAX_VOCAB_DIVISOR: u64 = 1 << 16;

/// The bound of a config.json size key; `None` for keys without a size meaning.
fn hf_bound(key: &str) -> Option<u64> {
    Some(match key {
        "num_hidden_layers" | "n_layer" => MAX_LAYERS,
        "hidden_size" | "n_embd" => MAX_HIDDEN,
        "num_attention_heads" | "n_head" | "num_key_value_heads" => MAX_HEADS,
        "head_dim" => MAX_KV_CHANNELS,
        "intermediate_size" | "n_inner" => MAX_FFN,
        "vocab_size" => MAX_VOCAB,
        "max_position_embeddings" | "n_positions" => MAX_POSITIONS,
        _ => return None,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    Llama,
    Qwen2,
    Gpt2,
}

impl Architecture {
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Gpt2 => "gpt2",
        }
    }
}

/// The `model` object of mflow-checkpoint.json, minus the TP-dependent padded vocab.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelShape {
    pub architecture: Architecture,
    pub num_layers: u64,
    pub hidden_size: u64,
    pub num_attention_heads: u64,
    pub num_query_groups: u64,
    pub kv_channels: u64,
    pub ffn_hidden_size: u64,
    pub gated_linear_unit: bool,
    /// "silu" or "gelu_tanh".
    pub activation: String,
    /// "RMSNorm" or "LayerNorm".
    pub normalization: String,
    pub layernorm_epsilon: f64,
    pub add_bias_linear: bool,
    pub add_qkv_bias: bool,
    /// "rope" or "learned_absolute".
    pub position_embedding_type: String,
    pub rotary_base: f64,
    pub rotary_percent: f64,
    pub rope_scaling: bool,
    pub rope_scaling_factor: f64,
    pub max_position_embeddings: u64,
    /// The true (Hugging Face) vocabulary size.
    pub vocab_size: u64,
    pub make_vocab_size_divisible_by: u64,
    pub share_embeddings_and_output_weights: bool,
}

impl ModelShape {
    /// Megatron's padded vocabulary for a tensor-parallel size.
    pub fn padded_vocab(&self, tp: u32) -> u64 {
        let m = self.make_vocab_size_divisible_by * tp as u64;
        self.vocab_size.div_ceil(m) * m
    }

    pub fn heads_per_group(&self) -> u64 {
        self.num_attention_heads / self.num_query_groups
    }

    /// Rows of the fused QKV weight: (heads + 2 * groups) * kv_channels.
    pub fn qkv_rows(&self) -> u64 {
        (self.num_attention_heads + 2 * self.num_query_groups) * self.kv_channels
    }

    /// Checks every size against its bound and every float for sense, naming the field (as in
    /// mflow-checkpoint.json) of `file` that is wrong. Shapes read from files must pass this
    /// before anything is planned from them.
    pub fn validate(&self, file: &str) -> Result<(), CkptError> {
        let sizes = [
            ("num_layers", self.num_layers, MAX_LAYERS),
            ("hidden_size", self.hidden_size, MAX_HIDDEN),
            ("num_attention_heads", self.num_attention_heads, MAX_HEADS),
            ("num_query_groups", self.num_query_groups, MAX_HEADS),
            ("kv_channels", self.kv_channels, MAX_KV_CHANNELS),
            ("ffn_hidden_size", self.ffn_hidden_size, MAX_FFN),
            ("max_position_embeddings", self.max_position_embeddings, MAX_POSITIONS),
            ("vocab_size", self.vocab_size, MAX_VOCAB),
            ("make_vocab_size_divisible_by", self.make_vocab_size_divisible_by, MAX_VOCAB_DIVISOR),
        ];
        for (key, value, limit) in sizes {
            if value == 0 {
                return Err(config_err(file, key, "is 0; it must be at least 1".into()));
            }
            if value > limit {
                return Err(CkptError::TooLarge {
                    file: file.into(),
                    key: key.into(),
                    value: value.to_string(),
                    limit,
                });
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_query_groups) {
            let reason =
                format!("{} does not divide num_attention_heads = {}", self.num_query_groups, self.num_attention_heads);
            return Err(config_err(file, "num_query_groups", reason));
        }
        let floats = [
            ("layernorm_epsilon", self.layernorm_epsilon, 1.0),
            ("rotary_base", self.rotary_base, f64::MAX),
            ("rotary_percent", self.rotary_percent, 1.0),
            ("rope_scaling_factor", self.rope_scaling_factor, f64::MAX),
        ];
        for (key, value, max) in floats {
            check_float(file, key, value, max)?;
        }
        let choices: [(&str, &str, &[&str]); 3] = [
            ("activation", &self.activation, &["silu", "gelu_tanh"]),
            ("normalization", &self.normalization, &["RMSNorm", "LayerNorm"]),
            ("position_embedding_type", &self.position_embedding_type, &["rope", "learned_absolute"]),
        ];
        for (key, value, allowed) in choices {
            if !allowed.contains(&value) {
                return Err(config_err(
                    file,
                    key,
                    format!("`{}` is not one of {}", excerpt(value), allowed.join(", ")),
                ));
            }
        }
        Ok(())
    }
}

fn config_err(file: &str, key: &str, reason: String) -> CkptError {
    CkptError::Config {
        file: file.into(),
        key: key.into(),
        reason,
        help: "fix the value; it cannot describe a real model".into(),
    }
}

/// A float must be finite, greater than 0 and at most `max`.
fn check_float(file: &str, key: &str, value: f64, max: f64) -> Result<(), CkptError> {
    if value.is_finite() && value > 0.0 && value <= max {
        Ok(())
    } else {
        let range = if max == f64::MAX {
            "a finite number greater than 0".to_string()
        } else {
            format!("a number in (0, {max}]")
        };
        Err(config_err(file, key, format!("is {value}; it must be {range}")))
    }
}

/// Checks that `tp` and `pp` split the model evenly, naming the field that does not divide.
pub fn check_parallelism(shape: &ModelShape, tp: u32, pp: u32) -> Result<(), CkptError> {
    let zero = |by: &str| CkptError::Parallelism {
        field: by.into(),
        value: 0,
        by: "at least".into(),
        divisor: 1,
        help: "tp and pp must be at least 1".into(),
    };
    if tp == 0 {
        return Err(zero("tp"));
    }
    if pp == 0 {
        return Err(zero("pp"));
    }
    let tp64 = tp as u64;
    let checks = [
        ("num_attention_heads", shape.num_attention_heads, "tp", tp64),
        ("num_query_groups (KV heads)", shape.num_query_groups, "tp", tp64),
        ("ffn_hidden_size", shape.ffn_hidden_size, "tp", tp64),
        ("num_layers", shape.num_layers, "pp", pp as u64),
    ];
    for (field, value, by, divisor) in checks {
        if value % divisor != 0 {
            return Err(CkptError::Parallelism {
                field: field.into(),
                value,
                by: by.into(),
                divisor,
                help: format!("choose a {by} that divides {field} ({value})"),
            });
        }
    }
    Ok(())
}

/// Reads a Hugging Face config.json value into a [`ModelShape`].
pub fn from_hf_config(file: &str, cfg: &Value) -> Result<ModelShape, CkptError> {
    let c = Cfg { file, v: cfg };
    if !cfg.is_object() {
        return Err(c.err(
            "(document)",
            format!("expected a JSON object, found {}", excerpt_of(cfg)),
            "fix config.json",
        ));
    }
    let model_type = c.str("model_type")?;
    let shape = match model_type.as_str() {
        "llama" => llama_like(&c, Architecture::Llama),
        "qwen2" => llama_like(&c, Architecture::Qwen2),
        "gpt2" => gpt2(&c),
        other => Err(c.err(
            "model_type",
            format!("architecture `{}` is not supported", excerpt(other)),
            "supported: llama, qwen2, gpt2",
        )),
    }?;
    // Backstop for what the per-key checks do not cover; names Megatron's field.
    shape.validate(file)?;
    Ok(shape)
}

struct Cfg<'a> {
    file: &'a str,
    v: &'a Value,
}

impl Cfg<'_> {
    fn err(&self, key: &str, reason: String, help: &str) -> CkptError {
        CkptError::Config { file: self.file.into(), key: key.into(), reason, help: help.into() }
    }
    fn get(&self, key: &str) -> Option<&Value> {
        self.v.get(key).filter(|v| !v.is_null())
    }
    fn u64(&self, key: &str) -> Result<u64, CkptError> {
        let n = match self.get(key) {
            Some(v) => v.as_u64().filter(|&n| n > 0).ok_or_else(|| {
                self.err(key, format!("expected a positive integer, found {}", excerpt_of(v)), "fix config.json")
            })?,
            None => return Err(self.err(key, "missing".into(), "config.json must set this field")),
        };
        match hf_bound(key) {
            Some(limit) if n > limit => {
                Err(CkptError::TooLarge { file: self.file.into(), key: key.into(), value: n.to_string(), limit })
            }
            _ => Ok(n),
        }
    }
    fn u64_or(&self, key: &str, default: u64) -> Result<u64, CkptError> {
        if self.get(key).is_some() {
            self.u64(key)
        } else {
            Ok(default)
        }
    }
    /// A positive, finite number (every float mflow reads is an epsilon, a base or a factor).
    fn f64_or(&self, key: &str, default: f64) -> Result<f64, CkptError> {
        match self.get(key) {
            Some(v) => self.positive(key, v),
            None => Ok(default),
        }
    }
    fn positive(&self, key: &str, v: &Value) -> Result<f64, CkptError> {
        match v.as_f64() {
            Some(x) if x.is_finite() && x > 0.0 => Ok(x),
            _ => Err(self.err(
                key,
                format!("expected a finite number greater than 0, found {}", excerpt_of(v)),
                "fix config.json",
            )),
        }
    }
    fn bool_or(&self, key: &str, default: bool) -> Result<bool, CkptError> {
        match self.get(key) {
            Some(v) => v.as_bool().ok_or_else(|| {
                self.err(key, format!("expected true or false, found {}", excerpt_of(v)), "fix config.json")
            }),
            None => Ok(default),
        }
    }
    fn str(&self, key: &str) -> Result<String, CkptError> {
        match self.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(v) => Err(self.err(key, format!("expected a string, found {}", excerpt_of(v)), "fix config.json")),
            None => Err(self.err(key, "missing".into(), "config.json must set this field")),
        }
    }
    fn require(&self, key: &str, ok: bool, reason: &str) -> Result<(), CkptError> {
        if ok {
            Ok(())
        } else {
            Err(self.err(
                key,
                reason.into(),
                "Megatron-Core's local layer spec cannot express this; use a model without it",
            ))
        }
    }
}

fn llama_like(c: &Cfg, arch: Architecture) -> Result<ModelShape, CkptError> {
    let hidden = c.u64("hidden_size")?;
    let heads = c.u64("num_attention_heads")?;
    let groups = c.u64_or("num_key_value_heads", heads)?;
    if heads % groups != 0 {
        return Err(c.err(
            "num_key_value_heads",
            format!("{groups} does not divide num_attention_heads = {heads}"),
            "fix config.json",
        ));
    }
    if hidden % heads != 0 && c.get("head_dim").is_none() {
        return Err(c.err(
            "hidden_size",
            format!("{hidden} is not divisible by num_attention_heads = {heads}"),
            "set head_dim",
        ));
    }
    let act = c.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
    c.require("hidden_act", act == "silu", &format!("activation `{}` is not supported (only silu)", excerpt(act)))?;
    match arch {
        Architecture::Llama => {
            c.require(
                "attention_bias",
                !c.bool_or("attention_bias", false)?,
                "attention biases are not supported for llama",
            )?;
            c.require("mlp_bias", !c.bool_or("mlp_bias", false)?, "MLP biases are not supported for llama")?;
        }
        _ => {
            c.require(
                "use_sliding_window",
                !c.bool_or("use_sliding_window", false)?,
                "sliding-window attention is not supported",
            )?;
        }
    }
    let (theta, scaling) = rope(c)?;
    Ok(ModelShape {
        architecture: arch,
        num_layers: c.u64("num_hidden_layers")?,
        hidden_size: hidden,
        num_attention_heads: heads,
        num_query_groups: groups,
        kv_channels: c.u64_or("head_dim", hidden / heads)?,
        ffn_hidden_size: c.u64("intermediate_size")?,
        gated_linear_unit: true,
        activation: "silu".into(),
        normalization: "RMSNorm".into(),
        layernorm_epsilon: c.f64_or("rms_norm_eps", 1e-6)?,
        add_bias_linear: false,
        add_qkv_bias: arch == Architecture::Qwen2,
        position_embedding_type: "rope".into(),
        rotary_base: theta,
        rotary_percent: 1.0,
        rope_scaling: scaling.is_some(),
        rope_scaling_factor: scaling.unwrap_or(8.0),
        max_position_embeddings: c.u64_or("max_position_embeddings", 2048)?,
        vocab_size: c.u64("vocab_size")?,
        make_vocab_size_divisible_by: VOCAB_DIVISOR,
        share_embeddings_and_output_weights: c.bool_or("tie_word_embeddings", false)?,
    })
}

/// Reads rope_theta and Llama-3 scaling from either `rope_parameters` (transformers 5) or the
/// older `rope_theta` + `rope_scaling` keys. Returns the scaling factor when scaling is on.
fn rope(c: &Cfg) -> Result<(f64, Option<f64>), CkptError> {
    let (key, params) = match (c.get("rope_parameters"), c.get("rope_scaling")) {
        (Some(p), _) => ("rope_parameters", Some(p)),
        (None, s) => ("rope_scaling", s),
    };
    let theta = match params.and_then(|p| p.get("rope_theta")).filter(|v| !v.is_null()) {
        Some(v) => c.positive(&format!("{key}.rope_theta"), v)?,
        None => c.f64_or("rope_theta", 10000.0)?,
    };
    let Some(p) = params else { return Ok((theta, None)) };
    let kind = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
    match kind {
        "default" => Ok((theta, None)),
        "llama3" => {
            // Megatron-Core hard-codes these three; only the factor is configurable.
            let fixed =
                [("low_freq_factor", 1.0), ("high_freq_factor", 4.0), ("original_max_position_embeddings", 8192.0)];
            for (name, want) in fixed {
                let got = p.get(name).and_then(Value::as_f64);
                if got != Some(want) {
                    return Err(c.err(
                        &format!("{key}.{name}"),
                        format!("is {got:?}, but Megatron-Core's llama3 rope scaling is fixed at {want}"),
                        "only Llama-3.1-style scaling (low 1, high 4, original 8192) is supported",
                    ));
                }
            }
            match p.get("factor").filter(|v| !v.is_null()) {
                Some(f) => Ok((theta, Some(c.positive(&format!("{key}.factor"), f)?))),
                None => Err(c.err(&format!("{key}.factor"), "missing".into(), "llama3 rope scaling needs a factor")),
            }
        }
        other => Err(c.err(
            &format!("{key}.rope_type"),
            format!("rope type `{}` is not supported", excerpt(other)),
            "supported: default, llama3",
        )),
    }
}

fn gpt2(c: &Cfg) -> Result<ModelShape, CkptError> {
    let hidden = c.u64("n_embd")?;
    let heads = c.u64("n_head")?;
    if hidden % heads != 0 {
        return Err(c.err("n_embd", format!("{hidden} is not divisible by n_head = {heads}"), "fix config.json"));
    }
    let act = c.get("activation_function").and_then(Value::as_str).unwrap_or("gelu_new");
    c.require(
        "activation_function",
        matches!(act, "gelu_new" | "gelu_pytorch_tanh"),
        &format!("activation `{}` is not supported (only gelu_new)", excerpt(act)),
    )?;
    c.require(
        "scale_attn_by_inverse_layer_idx",
        !c.bool_or("scale_attn_by_inverse_layer_idx", false)?,
        "per-layer attention scaling is not supported",
    )?;
    c.require("scale_attn_weights", c.bool_or("scale_attn_weights", true)?, "unscaled attention is not supported")?;
    c.require("add_cross_attention", !c.bool_or("add_cross_attention", false)?, "cross attention is not supported")?;
    Ok(ModelShape {
        architecture: Architecture::Gpt2,
        num_layers: c.u64("n_layer")?,
        hidden_size: hidden,
        num_attention_heads: heads,
        num_query_groups: heads,
        kv_channels: hidden / heads,
        ffn_hidden_size: c.u64_or("n_inner", 4 * hidden)?,
        gated_linear_unit: false,
        activation: "gelu_tanh".into(),
        normalization: "LayerNorm".into(),
        layernorm_epsilon: c.f64_or("layer_norm_epsilon", 1e-5)?,
        add_bias_linear: true,
        add_qkv_bias: true,
        position_embedding_type: "learned_absolute".into(),
        rotary_base: 10000.0,
        rotary_percent: 1.0,
        rope_scaling: false,
        rope_scaling_factor: 8.0,
        max_position_embeddings: c.u64("n_positions")?,
        vocab_size: c.u64("vocab_size")?,
        make_vocab_size_divisible_by: VOCAB_DIVISOR,
        share_embeddings_and_output_weights: c.bool_or("tie_word_embeddings", true)?,
    })
}
