"""Writes a synthetic Llama-3-8B-shaped Hugging Face checkpoint (bf16, random bytes, sharded at
5 GB with an index, untied), for conversion benchmarks only. Usage: synth8b.py OUT_DIR"""

import json
import os
import struct
import sys

out = sys.argv[1]
H, NH, NKV, FF, L, V = 4096, 32, 8, 14336, 32, 128256
HD = H // NH
cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": FF,
       "num_attention_heads": NH, "num_key_value_heads": NKV, "num_hidden_layers": L, "vocab_size": V,
       "head_dim": HD, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
       "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "tie_word_embeddings": False,
       "attention_bias": False, "mlp_bias": False, "dtype": "bfloat16"}
tensors = [("model.embed_tokens.weight", [V, H])]
for i in range(L):
    p = f"model.layers.{i}."
    tensors += [(p + "input_layernorm.weight", [H]), (p + "self_attn.q_proj.weight", [NH * HD, H]),
                (p + "self_attn.k_proj.weight", [NKV * HD, H]), (p + "self_attn.v_proj.weight", [NKV * HD, H]),
                (p + "self_attn.o_proj.weight", [H, NH * HD]), (p + "post_attention_layernorm.weight", [H]),
                (p + "mlp.gate_proj.weight", [FF, H]), (p + "mlp.up_proj.weight", [FF, H]), (p + "mlp.down_proj.weight", [H, FF])]
tensors += [("model.norm.weight", [H]), ("lm_head.weight", [V, H])]
nbytes = lambda s: 2 * (s[0] * (s[1] if len(s) > 1 else 1))
groups, size = [[]], 0
for t in tensors:
    if size and size + nbytes(t[1]) > 5_000_000_000:
        groups.append([]); size = 0
    groups[-1].append(t); size += nbytes(t[1])
os.makedirs(out, exist_ok=True)
block = os.urandom(64 << 20)
weight_map, total = {}, 0
for gi, g in enumerate(groups):
    name = f"model-{gi + 1:05}-of-{len(groups):05}.safetensors"
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for n, s in g:
        header[n] = {"dtype": "BF16", "shape": s, "data_offsets": [off, off + nbytes(s)]}
        off += nbytes(s); weight_map[n] = name
    js = json.dumps(header).encode()
    js += b" " * (-len(js) % 8)
    with open(os.path.join(out, name), "wb") as f:
        f.write(struct.pack("<Q", len(js)) + js)
        left, k = off, 0
        while left:
            n = min(left, len(block))
            f.write(block[k % 7 * 4096 :][:n] if n <= len(block) - k % 7 * 4096 else block[:n])
            left -= n; k += 1
    total += off
json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, open(os.path.join(out, "model.safetensors.index.json"), "w"))
json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)
