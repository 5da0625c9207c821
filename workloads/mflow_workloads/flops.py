"""Model FLOPs per global batch, with Megatron-Core 0.19's formula (megatron/training/training.py).

F = B*s*[6*h*ffn*(3 if GLU else 2)*L + 6*L*(h*(q+2*kv) + q*h) + 6*h*Vpad] + B*s^2*L*6*q,
q = kv_channels*heads, kv = kv_channels*groups. The attention s^2 term is halved for the causal
mask and doubled for QK^T and (QK^T)V, as in Megatron 0.19 (the older convention counts it twice).
"""

from __future__ import annotations

from .shards import ModelSpec


def flops_per_batch(spec: ModelSpec, batch: int, seq: int, padded_vocab: int) -> float:
    h, L = spec.hidden_size, spec.num_layers
    q = spec.kv_channels * spec.num_attention_heads
    kv = spec.kv_channels * spec.num_query_groups
    mlp = 6 * h * spec.ffn_hidden_size * (3 if spec.gated_linear_unit else 2) * L
    attn_proj = 6 * L * (h * (q + 2 * kv) + q * h)
    logits = 6 * h * padded_vocab
    return float(batch * seq * (mlp + attn_proj + logits) + batch * seq * seq * L * 6 * q)
