"""The straightforward Python conversion mflow's converter is measured against: safetensors.torch
loads each tensor, torch reshapes / chunks / concatenates, save_file writes one file per TP rank.
Llama family only, PP = 1. Usage: baseline.py HF_DIR OUT_DIR TP
"""

import json
import math
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file

src, out, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = json.load(open(os.path.join(src, "config.json")))
H, NH = cfg["hidden_size"], cfg["num_attention_heads"]
NKV = cfg.get("num_key_value_heads", NH)
HD = cfg.get("head_dim") or H // NH
L, V = cfg["num_hidden_layers"], cfg["vocab_size"]
tied = cfg.get("tie_word_embeddings", False)
Vp = math.ceil(V / (128 * tp)) * 128 * tp

index = os.path.join(src, "model.safetensors.index.json")
files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
handles = [safe_open(os.path.join(src, f), framework="pt") for f in files]
where = {k: h for h in handles for k in h.keys()}


def get(name):
    return where[name].get_tensor(name)


def pad(t):
    return torch.cat([t, t.new_zeros(Vp - t.shape[0], t.shape[1])]) if Vp > t.shape[0] else t


os.makedirs(out, exist_ok=True)
for r in range(tp):
    ch0 = lambda t: torch.chunk(t, tp, 0)[r].contiguous()
    ch1 = lambda t: torch.chunk(t, tp, 1)[r].contiguous()
    sd = {"embedding.word_embeddings.weight": ch0(pad(get("model.embed_tokens.weight")))}
    for i in range(L):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (get(p + f"self_attn.{x}_proj.weight") for x in "qkv")
        qkv = torch.cat([q.view(NKV, -1, H), k.view(NKV, HD, H), v.view(NKV, HD, H)], 1).reshape(-1, H)
        sd[m + "input_layernorm.weight"] = get(p + "input_layernorm.weight")
        sd[m + "self_attention.linear_qkv.weight"] = ch0(qkv)
        sd[m + "self_attention.linear_proj.weight"] = ch1(get(p + "self_attn.o_proj.weight"))
        sd[m + "pre_mlp_layernorm.weight"] = get(p + "post_attention_layernorm.weight")
        sd[m + "mlp.linear_fc1.weight"] = torch.cat([ch0(get(p + "mlp.gate_proj.weight")), ch0(get(p + "mlp.up_proj.weight"))])
        sd[m + "mlp.linear_fc2.weight"] = ch1(get(p + "mlp.down_proj.weight"))
    sd["decoder.final_layernorm.weight"] = get("model.norm.weight")
    if not tied:
        sd["output_layer.weight"] = ch0(pad(get("lm_head.weight")))
    save_file(sd, os.path.join(out, f"model_tp{r:02}_pp000.safetensors"), metadata={"format": "pt"})
    del sd
