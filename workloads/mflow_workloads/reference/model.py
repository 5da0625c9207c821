"""GPT with Megatron-Core local-spec names and per-rank shapes, tensor-parallel over `Parallel`.

With pipeline parallelism a rank builds only its stage, as Megatron's GPTModel does with
pre_process / post_process: the embedding on the first stage, the final norm and output layer on
the last, and the stage's own layers numbered from 0, so its state_dict is its shard file.

Each rank holds only its shard: column-parallel linears (qkv, fc1, output layer) keep rows
[r*n/tp, (r+1)*n/tp), row-parallel linears (proj, fc2) keep the matching input columns, and the
vocab-parallel embedding keeps its vocab slice. Replicated tensors are the norms, row-parallel
biases and learned position embeddings.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ParallelError
from ..shards import ModelSpec
from .parallel import Parallel, copy_to_tp, gather_from_tp, reduce_from_tp, vocab_parallel_cross_entropy


def _param(*shape: int, tp_split: bool) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(*shape))
    p.tensor_model_parallel = tp_split  # read by grad-norm clipping, as in Megatron
    return p


class Norm(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.rms = spec.normalization == "RMSNorm"
        self.eps = spec.layernorm_epsilon
        self.weight = _param(spec.hidden_size, tp_split=False)
        if not self.rms:
            self.bias = _param(spec.hidden_size, tp_split=False)

    def forward(self, x):
        if self.rms:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class ColumnLinear(nn.Module):
    def __init__(self, in_f: int, out_local: int, bias: bool, p: Parallel):
        super().__init__()
        self.p = p
        self.weight = _param(out_local, in_f, tp_split=True)
        if bias:
            self.bias = _param(out_local, tp_split=True)
        else:
            self.bias = None

    def forward(self, x):
        return F.linear(copy_to_tp(x, self.p), self.weight, self.bias)


class RowLinear(nn.Module):
    def __init__(self, in_local: int, out_f: int, bias: bool, p: Parallel):
        super().__init__()
        self.p = p
        self.weight = _param(out_f, in_local, tp_split=True)
        if bias:
            self.bias = _param(out_f, tp_split=False)
        else:
            self.bias = None

    def forward(self, x):
        y = reduce_from_tp(F.linear(x, self.weight), self.p)
        return y if self.bias is None else y + self.bias


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Megatron's RotaryEmbedding inverse frequencies, with its Llama-3.1 scaling when enabled."""
    dim = int(spec.kv_channels * spec.rotary_percent)
    inv = 1.0 / (spec.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if spec.rope_scaling:
        # Megatron hard-codes low 1, high 4, original context 8192; only the factor is configurable.
        factor, low, high, orig = spec.rope_scaling_factor, 1.0, 4.0, 8192.0
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > orig / low, inv / factor, inv)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < orig / high) & ~(wavelen > orig / low)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """t [b, s, heads, d]; rotate-half (non-interleaved) on the first cos.shape[-1] dims."""
    rot = cos.shape[-1]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    x1, x2 = t_rot.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    out = t_rot * cos.to(t.dtype) + rotated * sin.to(t.dtype)
    return torch.cat([out, t_pass], dim=-1) if t_pass.numel() else out


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, p: Parallel, kernel: str):
        super().__init__()
        if spec.num_query_groups % p.tp:
            raise ParallelError(
                f"num_query_groups {spec.num_query_groups} is not divisible by tp={p.tp}",
                "use a tp that divides the number of KV heads",
            )
        self.groups = spec.num_query_groups // p.tp
        self.per_group = spec.num_attention_heads // spec.num_query_groups
        self.hd = spec.kv_channels
        self.kernel = kernel
        qkv_rows = self.groups * (self.per_group + 2) * self.hd
        self.linear_qkv = ColumnLinear(spec.hidden_size, qkv_rows, spec.add_bias_linear or spec.add_qkv_bias, p)
        self.linear_proj = RowLinear(self.groups * self.per_group * self.hd, spec.hidden_size, spec.add_bias_linear, p)

    def forward(self, x, rope):
        b, s, _ = x.shape
        # Rows are interleaved per KV group: [q_g (per_group heads), k_g, v_g].
        qkv = self.linear_qkv(x).view(b, s, self.groups, self.per_group + 2, self.hd)
        q = qkv[:, :, :, : self.per_group].reshape(b, s, self.groups * self.per_group, self.hd)
        k = qkv[:, :, :, self.per_group]
        v = qkv[:, :, :, self.per_group + 1]
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        if self.per_group > 1:
            k = k.repeat_interleave(self.per_group, dim=1)
            v = v.repeat_interleave(self.per_group, dim=1)
        scale = 1.0 / math.sqrt(self.hd)
        if self.kernel == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)) * scale
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            o = torch.matmul(torch.softmax(scores.masked_fill(mask, float("-inf")).float(), -1).to(v.dtype), v)
        return self.linear_proj(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, p: Parallel):
        super().__init__()
        if spec.ffn_hidden_size % p.tp:
            raise ParallelError(
                f"ffn_hidden_size {spec.ffn_hidden_size} is not divisible by tp={p.tp}", "choose another tp"
            )
        ff_local = spec.ffn_hidden_size // p.tp
        self.gated = spec.gated_linear_unit
        self.act = F.silu if spec.activation == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
        self.linear_fc1 = ColumnLinear(spec.hidden_size, ff_local * (2 if self.gated else 1), spec.add_bias_linear, p)
        self.linear_fc2 = RowLinear(ff_local, spec.hidden_size, spec.add_bias_linear, p)

    def forward(self, x):
        h = self.linear_fc1(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)  # each rank holds [gate_r; up_r]
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return self.linear_fc2(h)


class Layer(nn.Module):
    def __init__(self, spec: ModelSpec, p: Parallel, kernel: str):
        super().__init__()
        self.input_layernorm = Norm(spec)
        self.self_attention = Attention(spec, p, kernel)
        self.pre_mlp_layernorm = Norm(spec)
        self.mlp = MLP(spec, p)

    def forward(self, x, rope):
        x = x + self.self_attention(self.input_layernorm(x), rope)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, spec: ModelSpec, p: Parallel, kernel: str, layers: int, post_process: bool):
        super().__init__()
        self.layers = nn.ModuleList(Layer(spec, p, kernel) for _ in range(layers))
        self.final_layernorm = Norm(spec) if post_process else None


class Embedding(nn.Module):
    def __init__(self, spec: ModelSpec, p: Parallel, vocab_local: int):
        super().__init__()
        self.p = p
        self.word_embeddings = nn.Module()
        self.word_embeddings.weight = _param(vocab_local, spec.hidden_size, tp_split=True)
        if spec.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Module()
            self.position_embeddings.weight = _param(spec.max_position_embeddings, spec.hidden_size, tp_split=False)
        else:
            self.position_embeddings = None

    def forward(self, tokens):
        w = self.word_embeddings.weight
        start = self.p.tp_rank * w.shape[0]
        local = tokens - start
        outside = (local < 0) | (local >= w.shape[0])
        x = F.embedding(local.clamp(0, w.shape[0] - 1), w) * (~outside).unsqueeze(-1).to(w.dtype)
        x = reduce_from_tp(x, self.p)
        if self.position_embeddings is not None:
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            x = x + self.position_embeddings.weight[pos].unsqueeze(0)
        return x


class GPT(nn.Module):
    def __init__(
        self, spec: ModelSpec, p: Parallel, tp: int | None = None, attention: str = "sdpa", layers: int | None = None
    ):
        super().__init__()
        self.spec, self.p = spec, p
        padded = spec.padded_vocab_for(tp or p.tp)
        if padded % p.tp:
            raise ParallelError(f"padded vocab {padded} not divisible by tp={p.tp}", "re-run convert for this tp")
        vocab_local = padded // p.tp
        layers = spec.num_layers if layers is None else layers
        if p.pp == 1 and layers != spec.num_layers:
            raise ParallelError(
                f"{layers} layers asked of a single stage of a {spec.num_layers}-layer model",
                "pass the stage's layer count only with pp > 1",
            )
        self.pre_process, self.post_process = p.is_first_stage, p.is_last_stage
        self.embedding = Embedding(spec, p, vocab_local) if self.pre_process else None
        self.decoder = Decoder(spec, p, attention, layers, self.post_process)
        self.tied = spec.share_embeddings_and_output_weights
        # Tied at pp > 1: the last stage holds its own copy, kept equal to the first stage's
        # embedding by an all-reduce of the two gradients (Megatron's embedding group).
        self.has_output_layer = self.post_process and (not self.tied or not self.pre_process)
        if self.has_output_layer:
            self.output_layer = nn.Module()
            self.output_layer.weight = _param(vocab_local, spec.hidden_size, tp_split=True)
            self.output_layer.weight.shared_copy = self.tied
        self.use_rope = spec.position_embedding_type == "rope"
        self.register_buffer("inv_freq", rope_inv_freq(spec), persistent=False)

    def _rope(self, s: int, device):
        if not self.use_rope:
            return None
        freqs = torch.outer(torch.arange(s, device=device, dtype=torch.float32), self.inv_freq.to(device))
        emb = torch.cat([freqs, freqs], dim=-1)[None, :, None, :]  # [1, s, 1, rot]
        return emb.cos(), emb.sin()

    def shared_embedding(self) -> torch.nn.Parameter | None:
        """This stage's copy of a tied embedding when pp > 1 (None elsewhere)."""
        if not self.tied or self.p.pp == 1:
            return None
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight if self.post_process else None

    def forward(self, tokens: torch.Tensor | None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Local vocab-parallel logits [b, s, Vp/tp] on the last stage, else the hidden states
        [b, s, H] for the next one. The first stage reads `tokens`, the others `hidden`."""
        x = self.embedding(tokens) if self.pre_process else hidden
        rope = self._rope(x.shape[1], x.device)
        for layer in self.decoder.layers:
            x = layer(x, rope)
        if not self.post_process:
            return x
        x = self.decoder.final_layernorm(x)
        w = self.output_layer.weight if self.has_output_layer else self.embedding.word_embeddings.weight
        return F.linear(copy_to_tp(x, self.p), w)

    def loss(
        self, tokens: torch.Tensor | None, labels: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-token loss [b, s] (last stage)."""
        return vocab_parallel_cross_entropy(self.forward(tokens, hidden), labels, self.p)

    def full_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Gathered logits over the true vocab [b, s, V]."""
        return gather_from_tp(self.forward(tokens), self.p)[..., : self.spec.vocab_size]


def build(
    spec: ModelSpec,
    p: Parallel,
    state: dict[str, torch.Tensor],
    tp: int | None = None,
    attention: str = "sdpa",
    device="cpu",
    layers: int | None = None,
) -> GPT:
    """Builds the model (the rank's stage, of `layers` layers, when pp > 1) and loads one rank's
    state with strict=True (fp32 master weights)."""
    model = GPT(spec, p, tp=tp, attention=attention, layers=layers)
    model.load_state_dict({k: v.float() for k, v in state.items() if not k.endswith("_extra_state")}, strict=True)
    return model.to(device)


@torch.no_grad()
def greedy_generate(
    model: GPT, prompt_ids: list[int], max_new_tokens: int, device="cpu", autocast_dtype: torch.dtype | None = None
) -> list[int]:
    """Greedy decoding by full recomputation; every tp rank returns the same ids."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        t = torch.tensor([ids], dtype=torch.long, device=device)
        with torch.autocast(
            device_type=t.device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None
        ):
            logits = model.full_logits(t)[0, -1].float()
        ids.append(int(logits.argmax()))
    return ids[len(prompt_ids) :]
