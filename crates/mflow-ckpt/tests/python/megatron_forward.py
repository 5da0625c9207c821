"""Checks mflow shards against Hugging Face transformers.

    perturb SRC DST     load a Hugging Face model, give every norm and bias random values (presets
                        start them at 1 and 0, which would hide mapping mistakes), save to DST
    compare HF SHARDS   fp32 logits of transformers on HF vs a plain-PyTorch forward that follows
                        Megatron-Core's layout on the per-rank shards, simulating tensor parallelism
                        by computing each rank's slice and summing / concatenating as Megatron does

Prints one JSON line.
"""

import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def perturb(src, dst):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "bias" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            elif p.dim() == 1:
                p.copy_(1 + torch.rand(p.shape, generator=g) - 0.5)
    model.save_pretrained(dst)
    tok.save_pretrained(dst)
    ids = tok("A pipeline is a plan.")["input_ids"]
    print(json.dumps({"tokenizer_ids": ids, "vocab": len(tok)}))


class Ranks:
    """Per-rank tensors of a shards directory, with Megatron's local layer numbering undone."""

    def __init__(self, d):
        self.m = json.load(open(os.path.join(d, "mflow-checkpoint.json")))
        self.tp, self.pp = self.m["tp"], self.m["pp"]
        self.files = {}
        for f in self.m["files"]:
            self.files[(f["tp"], f["pp"])] = load_file(os.path.join(d, f["path"]))

    def get(self, t, name, stage=None):
        if stage is None:
            stage = 0
        return self.files[(t, stage)][name].float()

    def replicated(self, name, stage):
        vals = [self.get(t, name, stage) for t in range(self.tp)]
        for v in vals[1:]:
            assert torch.equal(v, vals[0]), f"{name} differs across TP ranks"
        return vals[0]

    def layer(self, i):
        per = self.m["layers_per_stage"][0]
        return i // per, f"decoder.layers.{i % per}."


def rope_freqs(m, hd, S):
    inv = 1.0 / (m["rotary_base"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    if m["rope_scaling"]:
        # Megatron-Core's llama3 scaling: low 1, high 4, original 8192.
        factor, low, high, orig = m["rope_scaling_factor"], 1.0, 4.0, 8192
        low_wl, high_wl = orig / low, orig / high
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > low_wl, inv / factor, inv)
        smooth = (orig / wl - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wl >= high_wl) & (wl <= low_wl)
        inv = torch.where(is_mid, mid, scaled)
    ang = torch.outer(torch.arange(S, dtype=torch.float32), inv)
    emb = torch.cat([ang, ang], -1)
    return emb.cos(), emb.sin()


def rotate(x, cos, sin):
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], -1)
    return x * cos + rot * sin


def norm(m, x, w, b):
    if m["normalization"] == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m["layernorm_epsilon"]) * w
    return F.layer_norm(x, (x.shape[-1],), w, b, m["layernorm_epsilon"])


def megatron_logits(d, tokens, control=False):
    R = Ranks(d)
    m = R.m["model"]
    tp = R.tp
    B, S = tokens.shape
    V, Vp = m["vocab_size"], m["padded_vocab_size"]
    per = Vp // tp
    hd = m["kv_channels"]
    groups = m["num_query_groups"] // tp
    r = m["num_attention_heads"] // m["num_query_groups"]
    bias = m["add_bias_linear"]
    last = R.pp - 1

    # Vocab-parallel embedding: each rank looks up its own rows, the results are summed.
    x = torch.zeros(B, S, m["hidden_size"])
    for t in range(tp):
        w = R.get(t, "embedding.word_embeddings.weight", 0)
        local = tokens - t * per
        mask = (local >= 0) & (local < per)
        x += F.embedding(local.clamp(0, per - 1), w) * mask.unsqueeze(-1)
    if m["position_embedding_type"] == "learned_absolute":
        x += R.replicated("embedding.position_embeddings.weight", 0)[:S]
    cos, sin = rope_freqs(m, hd, S)
    causal = torch.full((S, S), float("-inf")).triu(1)

    for i in range(m["num_layers"]):
        stage, p = R.layer(i)
        nb = lambda n: R.replicated(p + n + ".bias", stage) if bias else None
        h = norm(m, x, R.replicated(p + "input_layernorm.weight", stage), nb("input_layernorm"))
        out = torch.zeros_like(x)
        for t in range(tp):
            qkv = h @ R.get(t, p + "self_attention.linear_qkv.weight", stage).T
            if m["add_qkv_bias"]:
                qkv = qkv + R.get(t, p + "self_attention.linear_qkv.bias", stage)
            if control:
                # Deliberately wrong: read the fused QKV as [q_all; k_all; v_all].
                q, k, v = qkv.split([groups * r * hd, groups * hd, groups * hd], -1)
                q = q.view(B, S, groups * r, hd).transpose(1, 2)
                k = k.view(B, S, groups, hd).transpose(1, 2).repeat_interleave(r, dim=1)
                v = v.view(B, S, groups, hd).transpose(1, 2).repeat_interleave(r, dim=1)
            else:
                qkv = qkv.view(B, S, groups, r + 2, hd)
                q = qkv[:, :, :, :r].reshape(B, S, groups * r, hd).transpose(1, 2)
                k = qkv[:, :, :, r].transpose(1, 2).repeat_interleave(r, dim=1)
                v = qkv[:, :, :, r + 1].transpose(1, 2).repeat_interleave(r, dim=1)
            if m["position_embedding_type"] == "rope":
                q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + causal, -1)
            ctx = (att @ v).transpose(1, 2).reshape(B, S, -1)
            out += ctx @ R.get(t, p + "self_attention.linear_proj.weight", stage).T  # row-parallel: all-reduce
        if bias:
            out += R.replicated(p + "self_attention.linear_proj.bias", stage)
        x = x + out
        h = norm(m, x, R.replicated(p + "pre_mlp_layernorm.weight", stage), nb("pre_mlp_layernorm"))
        out = torch.zeros_like(x)
        for t in range(tp):
            a = h @ R.get(t, p + "mlp.linear_fc1.weight", stage).T
            if bias:
                a = a + R.get(t, p + "mlp.linear_fc1.bias", stage)
            if m["gated_linear_unit"]:
                gate, up = torch.chunk(a, 2, dim=-1)  # per rank: [gate_r; up_r]
                a = F.silu(gate) * up
            else:
                a = F.gelu(a, approximate="tanh")
            out += a @ R.get(t, p + "mlp.linear_fc2.weight", stage).T
        if bias:
            out += R.replicated(p + "mlp.linear_fc2.bias", stage)
        x = x + out

    fb = R.replicated("decoder.final_layernorm.bias", last) if bias else None
    x = norm(m, x, R.replicated("decoder.final_layernorm.weight", last), fb)
    parts = []
    for t in range(tp):
        if "output_layer.weight" in R.files[(t, last)]:
            w = R.get(t, "output_layer.weight", last)
            if m["share_embeddings_and_output_weights"]:
                # Tied with pp > 1: the last stage's copy must equal the first stage's embedding.
                assert torch.equal(w, R.get(t, "embedding.word_embeddings.weight", 0))
        else:
            assert m["share_embeddings_and_output_weights"]
            w = R.get(t, "embedding.word_embeddings.weight", 0)
        parts.append(x @ w.T)  # column-parallel over the vocab: gather
    logits = torch.cat(parts, -1)
    assert torch.all(logits[..., V:] == 0), "padded vocab rows must be zero"
    return logits[..., :V]


def compare(hf_dir, shards):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    V = model.config.vocab_size
    tokens = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(tokens).logits.float()
        got = megatron_logits(shards, tokens)
        wrong = megatron_logits(shards, tokens, control=True)
    diff = (ref - got).abs().max().item()
    cos = F.cosine_similarity(ref.flatten(), got.flatten(), dim=0).item()
    control = (ref - wrong).abs().max().item()
    print(json.dumps({"max_abs_diff": diff, "cosine": cos, "ref_abs_max": ref.abs().max().item(), "control_max_abs_diff": control}))


if __name__ == "__main__":
    torch.manual_seed(0)
    cmd = sys.argv[1]
    if cmd == "perturb":
        perturb(sys.argv[2], sys.argv[3])
    elif cmd == "compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"unknown command {cmd}")
