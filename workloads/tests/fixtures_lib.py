"""Builds small real inputs for the workload tests: a BPE tokenizer trained on the corpus
fixture, random-init HF models saved by transformers, Megatron indexed datasets, and mflow
shards converted from HF with plain tensor operations (Megatron's local-spec layout).

When MFLOW_BIN names an mflow binary with a `convert` subcommand, `convert_hf_to_shards` can
use it instead (see `convert_with_binary`).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess

import numpy as np
import torch
from safetensors.torch import load_file

from mflow_workloads import shards as S

HERE = os.path.dirname(os.path.abspath(__file__))

CORPUS = os.path.join(HERE, "fixtures", "corpus.txt")


def corpus_documents() -> list[str]:
    with open(CORPUS, encoding="utf-8") as f:
        text = f.read()
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def make_tokenizer(out_dir: str, vocab_size: int = 512) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_documents(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return out_dir


def make_hf_model(
    out_dir: str,
    tok_dir: str,
    arch: str = "llama",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    tied: bool = False,
    seed: int = 0,
    rope_theta: float = 500000.0,
    llama3_scaling: bool = False,
    max_pos: int = 256,
    vocab: int | None = None,
    init_range: float = 0.05,
) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    vocab = vocab or len(tok)
    kw = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tied,
        "initializer_range": init_range,
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.bos_token_id,
    }
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if llama3_scaling:
        rope = {
            "rope_type": "llama3",
            "rope_theta": rope_theta,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    if arch == "llama":
        from transformers import LlamaConfig as C, LlamaForCausalLM as M

        kw.update(attention_bias=False, mlp_bias=False, head_dim=hidden // heads)
    elif arch == "qwen2":
        from transformers import Qwen2Config as C, Qwen2ForCausalLM as M

        rope = {"rope_type": "default", "rope_theta": rope_theta}
    else:
        raise ValueError(arch)
    cfg = C(**kw, rope_parameters=rope)
    torch.manual_seed(seed)
    model = M(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("bias"):
                p.normal_(0, 0.05)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def hf_to_full_local(hf: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """HF Llama/Qwen2 tensors -> unsharded Megatron local-spec tensors (true vocab)."""
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    nh, ng = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    r = nh // ng
    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not cfg.get("tie_word_embeddings", False):
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(L):
        a, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (hf[a + f"self_attn.{x}_proj.weight"] for x in "qkv")
        out[m + "self_attention.linear_qkv.weight"] = torch.cat(
            [q.view(ng, r * hd, H), k.view(ng, hd, H), v.view(ng, hd, H)], dim=1
        ).reshape(-1, H)
        if a + "self_attn.q_proj.bias" in hf:
            qb, kb, vb = (hf[a + f"self_attn.{x}_proj.bias"] for x in "qkv")
            out[m + "self_attention.linear_qkv.bias"] = torch.cat(
                [qb.view(ng, r * hd), kb.view(ng, hd), vb.view(ng, hd)], dim=1
            ).reshape(-1)
        out[m + "self_attention.linear_proj.weight"] = hf[a + "self_attn.o_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[a + "mlp.gate_proj.weight"], hf[a + "mlp.up_proj.weight"]], 0)
        out[m + "mlp.linear_fc2.weight"] = hf[a + "mlp.down_proj.weight"]
        out[m + "input_layernorm.weight"] = hf[a + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[a + "post_attention_layernorm.weight"]
    return out


def convert_hf_to_shards(hf_dir: str, out_dir: str, tp: int, dtype: str = "float32", pp: int = 1) -> str:
    """Python conversion HF -> mflow shards (Megatron local spec), following megatron.md section 2;
    pipeline stages as mflow convert places them (test_pipeline checks it against the binary)."""
    if os.environ.get("MFLOW_BIN"):
        return convert_with_binary(hf_dir, out_dir, tp, dtype, pp)
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = ["model.safetensors"]
    hf = {}
    for name in names:
        hf.update(load_file(os.path.join(hf_dir, name)))
    if cfg.get("tie_word_embeddings") and "lm_head.weight" in hf:
        del hf["lm_head.weight"]
    full = hf_to_full_local(hf, cfg)
    arch = cfg["model_type"]
    rope = cfg.get("rope_parameters") or {}
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    model = {
        "num_layers": cfg["num_hidden_layers"],
        "hidden_size": H,
        "num_attention_heads": nh,
        "num_query_groups": cfg["num_key_value_heads"],
        "kv_channels": cfg.get("head_dim") or H // nh,
        "ffn_hidden_size": cfg["intermediate_size"],
        "gated_linear_unit": True,
        "activation": "silu",
        "normalization": "RMSNorm",
        "layernorm_epsilon": cfg["rms_norm_eps"],
        "add_bias_linear": False,
        "add_qkv_bias": arch == "qwen2",
        "position_embedding_type": "rope",
        "rotary_base": rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        "rotary_percent": 1.0,
        "rope_scaling": rope.get("rope_type") == "llama3",
        "rope_scaling_factor": rope.get("factor", 8.0),
        "max_position_embeddings": cfg["max_position_embeddings"],
        "vocab_size": cfg["vocab_size"],
        "padded_vocab_size": S.padded_vocab_size(cfg["vocab_size"], tp),
        "make_vocab_size_divisible_by": 128,
        "share_embeddings_and_output_weights": bool(cfg.get("tie_word_embeddings", False)),
    }
    if model["num_layers"] % pp:
        raise ValueError(f"pp={pp} does not divide {model['num_layers']} layers")
    lps = [model["num_layers"] // pp] * pp
    manifest = {
        "format": S.FORMAT,
        "version": 1,
        "architecture": arch,
        "dtype": dtype,
        "tp": tp,
        "pp": pp,
        "layers_per_stage": lps,
        "model": model,
        "files": [{"tp": t, "pp": s, "path": S.shard_file_name(t, s)} for s in range(pp) for t in range(tp)],
    }
    spec = S.ModelSpec(architecture=arch, **model)
    os.makedirs(os.path.join(out_dir, "tokenizer"), exist_ok=True)
    for s, stage in enumerate(S.split_pp(full, lps, spec.share_embeddings_and_output_weights)):
        for t, part in enumerate(S.split_tp(stage, spec, tp)):
            S.write_rank_file(out_dir, t, s, part, S.DTYPES[dtype])
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        p = os.path.join(hf_dir, name)
        if os.path.exists(p):
            with open(p, "rb") as src, open(os.path.join(out_dir, "tokenizer", name), "wb") as dst:
                dst.write(src.read())
    with open(os.path.join(out_dir, "hf_config.json"), "w") as f:
        json.dump(cfg, f)
    manifest["_spec"] = spec
    S.finalize_shards(out_dir, out_dir, manifest)
    return out_dir


def convert_with_binary(hf_dir: str, out_dir: str, tp: int, dtype: str, pp: int = 1, binary: str | None = None) -> str:
    cmd = [
        binary or os.environ["MFLOW_BIN"],
        "convert",
        hf_dir,
        out_dir,
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--dtype",
        dtype,
    ]
    subprocess.run(cmd, check=True)
    return out_dir


IDX_CODES = {np.uint16: 8, np.int32: 4}


def write_indexed(prefix: str, docs: list[np.ndarray], dtype=np.uint16) -> None:
    """Megatron MMIDIDX writer: one sequence per document."""
    lengths = np.array([len(d) for d in docs], dtype=np.int32)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64) * itemsize]).astype(np.int64)
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(np.asarray(d, dtype=dtype).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", IDX_CODES[dtype]))
        f.write(struct.pack("<Q", len(docs)))
        f.write(struct.pack("<Q", len(docs) + 1))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(len(docs) + 1, dtype=np.int64).tobytes())


def make_dataset(out_dir: str, tok_dir: str) -> str:
    """Tokenizes the corpus fixture into train/valid/test (every 10th document valid, 11th test)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    eod = tok.token_to_id("<|endoftext|>")
    splits = {"train": [], "valid": [], "test": []}
    for i, doc in enumerate(corpus_documents()):
        ids = np.array([*tok.encode(doc).ids, eod], dtype=np.uint16)
        name = "valid" if i % 10 == 3 else "test" if i % 10 == 7 else "train"
        splits[name].append(ids)
    os.makedirs(out_dir, exist_ok=True)
    stats = {}
    for name, docs in splits.items():
        write_indexed(os.path.join(out_dir, name), docs)
        stats[name] = {"documents": len(docs), "tokens": int(sum(len(d) for d in docs))}
    meta = {
        "format": "mflow-dataset",
        "version": 1,
        "vocab_size": tok.get_vocab_size(),
        "eod_id": eod,
        "dtype": "uint16",
        "splits": stats,
        "tokenizer": "tokenizer.json",
    }
    with open(os.path.join(out_dir, "dataset.json"), "w") as f:
        json.dump(meta, f)
    with open(os.path.join(out_dir, "stats.json"), "w") as f:
        json.dump(stats, f)
    with (
        open(os.path.join(tok_dir, "tokenizer.json"), "rb") as src,
        open(os.path.join(out_dir, "tokenizer.json"), "wb") as dst,
    ):
        dst.write(src.read())
    return out_dir
