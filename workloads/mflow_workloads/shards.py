"""mflow Megatron shards: `mflow-checkpoint.json` plus one safetensors file per (tp, pp) rank.

Keys are Megatron-Core local-spec `state_dict()` names with per-rank shapes. This module reads and
checks a shard set, loads one rank's tensors, merges or re-splits tensor-parallel ranks, and writes
a shard set in the same layout.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import ShardsError

MANIFEST = "mflow-checkpoint.json"
FORMAT = "mflow-megatron-shards"
MAX_MANIFEST_BYTES = 16 << 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_KEYS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "gated_linear_unit",
    "activation",
    "normalization",
    "layernorm_epsilon",
    "add_bias_linear",
    "add_qkv_bias",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "rope_scaling",
    "rope_scaling_factor",
    "max_position_embeddings",
    "vocab_size",
    "padded_vocab_size",
    "make_vocab_size_divisible_by",
    "share_embeddings_and_output_weights",
)


def shard_file_name(tp_rank: int, pp_rank: int) -> str:
    return f"model_tp{tp_rank:02}_pp{pp_rank:03}.safetensors"


def padded_vocab_size(vocab: int, tp: int, divisible_by: int = 128) -> int:
    mult = divisible_by * tp
    return int(math.ceil(vocab / mult) * mult)


@dataclass(frozen=True)
class ModelSpec:
    """The architecture fields of `mflow-checkpoint.json` ("model")."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    gated_linear_unit: bool
    activation: str
    normalization: str
    layernorm_epsilon: float
    add_bias_linear: bool
    add_qkv_bias: bool
    position_embedding_type: str
    rotary_base: float
    rotary_percent: float
    rope_scaling: bool
    rope_scaling_factor: float
    max_position_embeddings: int
    vocab_size: int
    padded_vocab_size: int
    make_vocab_size_divisible_by: int
    share_embeddings_and_output_weights: bool

    @classmethod
    def from_manifest(cls, m: dict[str, Any], where: str) -> ModelSpec:
        model = m.get("model")
        if not isinstance(model, dict):
            raise ShardsError(
                f"{where}: key 'model' is missing or not an object", "regenerate the shards with mflow convert"
            )
        missing = [k for k in MODEL_KEYS if k not in model]
        if missing:
            raise ShardsError(
                f"{where}: model keys missing: {', '.join(missing)}", "regenerate the shards with this mflow version"
            )
        spec = cls(architecture=m.get("architecture", "llama"), **{k: model[k] for k in MODEL_KEYS})
        if spec.activation not in ("silu", "gelu_tanh"):
            raise ShardsError(
                f"{where}: model.activation {spec.activation!r} is not supported", "use silu or gelu_tanh"
            )
        if spec.normalization not in ("RMSNorm", "LayerNorm"):
            raise ShardsError(
                f"{where}: model.normalization {spec.normalization!r} is not supported", "use RMSNorm or LayerNorm"
            )
        if spec.position_embedding_type not in ("rope", "learned_absolute"):
            raise ShardsError(
                f"{where}: model.position_embedding_type {spec.position_embedding_type!r}",
                "use rope or learned_absolute",
            )
        if spec.num_attention_heads % spec.num_query_groups:
            raise ShardsError(
                f"{where}: num_attention_heads {spec.num_attention_heads} is not a multiple of "
                f"num_query_groups {spec.num_query_groups}",
                "fix the model config",
            )
        return spec

    def padded_vocab_for(self, tp: int) -> int:
        return padded_vocab_size(self.vocab_size, tp, self.make_vocab_size_divisible_by)


def read_manifest(shards_dir: str) -> dict[str, Any]:
    path = os.path.join(shards_dir, MANIFEST)
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise ShardsError(
            f"{path}: cannot read the shard manifest: {e}",
            "point 'shards' at a directory produced by mflow convert or train",
        ) from e
    if size > MAX_MANIFEST_BYTES:
        raise ShardsError(
            f"{path}: manifest is {size} bytes (limit {MAX_MANIFEST_BYTES})", "the manifest is small JSON"
        )
    try:
        with open(path, encoding="utf-8") as f:
            m = json.load(f)
    except json.JSONDecodeError as e:
        raise ShardsError(f"{path}: invalid JSON: {e}", "regenerate the shards") from e
    if m.get("format") != FORMAT or m.get("version") != 1:
        raise ShardsError(
            f"{path}: format {m.get('format')!r} version {m.get('version')!r}", f"expected format '{FORMAT}' version 1"
        )
    for k in ("tp", "pp", "dtype", "layers_per_stage", "files"):
        if k not in m:
            raise ShardsError(f"{path}: key '{k}' is missing", "regenerate the shards with mflow convert")
    if m["dtype"] not in DTYPES:
        raise ShardsError(f"{path}: dtype {m['dtype']!r} is not supported", f"use one of {', '.join(DTYPES)}")
    spec = ModelSpec.from_manifest(m, path)
    if (
        m["tp"] < 1
        or m["pp"] < 1
        or len(m["layers_per_stage"]) != m["pp"]
        or sum(m["layers_per_stage"]) != spec.num_layers
    ):
        raise ShardsError(
            f"{path}: tp/pp/layers_per_stage are inconsistent with num_layers {spec.num_layers}",
            "regenerate the shards",
        )
    if spec.padded_vocab_size != spec.padded_vocab_for(m["tp"]):
        raise ShardsError(
            f"{path}: padded_vocab_size {spec.padded_vocab_size} != "
            f"ceil(V/(divisor*tp))*divisor*tp = {spec.padded_vocab_for(m['tp'])}",
            "regenerate the shards; padding follows Megatron's make_vocab_size_divisible_by*tp",
        )
    seen = set()
    for entry in m["files"]:
        name = entry.get("path", "")
        expected = shard_file_name(entry.get("tp", -1), entry.get("pp", -1))
        # A manifest path must be a bare file name of the fixed pattern: nothing may escape the directory.
        if name != expected or "/" in name or "\\" in name:
            raise ShardsError(
                f"{path}: file entry {name!r} does not match {expected!r}",
                "shard files are named model_tpXX_ppYYY.safetensors inside the shard directory",
            )
        seen.add((entry["tp"], entry["pp"]))
    want = {(t, p) for t in range(m["tp"]) for p in range(m["pp"])}
    if seen != want:
        raise ShardsError(
            f"{path}: files cover ranks {sorted(seen)}, expected {sorted(want)}",
            "every (tp, pp) rank needs exactly one file",
        )
    m["_spec"] = spec
    return m


def spec_of(manifest: dict[str, Any]) -> ModelSpec:
    return manifest["_spec"]


def blake3_file(path: str) -> str:
    try:
        import blake3
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ShardsError("python package 'blake3' is not installed", "pip install blake3") from e
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update_mmap(path)
    return h.hexdigest()


def load_rank(
    shards_dir: str, manifest: dict[str, Any], tp_rank: int, pp_rank: int = 0, verify_digest: bool = True
) -> dict[str, torch.Tensor]:
    """Loads one rank's tensors (safetensors only), after checking its size and digest."""
    entry = next(e for e in manifest["files"] if e["tp"] == tp_rank and e["pp"] == pp_rank)
    path = os.path.join(shards_dir, entry["path"])
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise ShardsError(
            f"{path}: missing shard file: {e}", "the shard directory is incomplete; re-run convert"
        ) from e
    if "bytes" in entry and size != entry["bytes"]:
        raise ShardsError(
            f"{path}: size {size} != {entry['bytes']} recorded in {MANIFEST}",
            "the file was truncated or replaced; re-run convert",
        )
    if verify_digest and entry.get("blake3"):
        digest = blake3_file(path)
        if digest != entry["blake3"]:
            raise ShardsError(
                f"{path}: blake3 {digest} != {entry['blake3']} recorded in {MANIFEST}",
                "the file is corrupt; re-run convert",
            )
    out = {}
    try:
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    except Exception as e:
        raise ShardsError(f"{path}: not a readable safetensors file: {e}", "re-run convert") from e
    return out


def column_keys(spec: ModelSpec) -> list[str]:
    """Tensors split along dim 0 (column-parallel and vocab-parallel)."""
    keys = ["embedding.word_embeddings.weight"]
    if not spec.share_embeddings_and_output_weights:
        keys.append("output_layer.weight")
    return keys


def _tp_kind(key: str) -> tuple[str, int]:
    """('vocab'|'qkv'|'fc1'|'row'|'rep', dim) for a local-spec key."""
    if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "vocab", 0
    if re.search(r"self_attention\.linear_qkv\.(weight|bias)$", key):
        return "col", 0
    if re.search(r"mlp\.linear_fc1\.(weight|bias)$", key):
        return "fc1", 0
    if re.search(r"(linear_proj|linear_fc2)\.weight$", key):
        return "row", 1
    return "rep", -1


def merge_tp(ranks: list[dict[str, torch.Tensor]], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Joins tensor-parallel ranks into one unsharded state dict with the true vocab (no padding)."""
    out = {}
    for key in ranks[0]:
        kind, _ = _tp_kind(key)
        parts = [r[key] for r in ranks]
        if kind == "rep":
            out[key] = parts[0].clone()
        elif kind == "fc1" and spec.gated_linear_unit:
            halves = [p.chunk(2, dim=0) for p in parts]  # each rank is [gate_r; up_r]
            out[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        elif kind == "row":
            out[key] = torch.cat(parts, dim=1)
        else:
            out[key] = torch.cat(parts, dim=0)
        if kind == "vocab":
            out[key] = out[key][: spec.vocab_size].clone()
    return out


def split_tp(full: dict[str, torch.Tensor], spec: ModelSpec, tp: int) -> list[dict[str, torch.Tensor]]:
    """Splits an unsharded state dict (true vocab) into `tp` ranks, padding the vocab for `tp`."""
    padded = spec.padded_vocab_for(tp)
    ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for key, t in full.items():
        kind, dim = _tp_kind(key)
        if kind == "vocab":
            t = torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])], dim=0)
        if kind == "rep":
            parts = [t.clone() for _ in range(tp)]
        elif kind == "fc1" and spec.gated_linear_unit:
            gate, up = t.chunk(2, dim=0)
            parts = [torch.cat([g, u], dim=0) for g, u in zip(gate.chunk(tp, 0), up.chunk(tp, 0), strict=True)]
        else:
            if t.shape[dim] % tp:
                raise ShardsError(
                    f"tensor {key}: dim {dim} of size {t.shape[dim]} is not divisible by tp={tp}",
                    "choose a tp that divides heads, query groups and ffn size",
                )
            parts = list(t.chunk(tp, dim=dim))
        for r in range(tp):
            ranks[r][key] = parts[r].contiguous()
    return ranks


_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def stage_layers(manifest: dict[str, Any], pp_rank: int) -> range:
    """Global layer numbers held by pipeline stage `pp_rank`, from the manifest's layers_per_stage
    (the converter writes num_layers/pp contiguous layers per stage, numbered from 0 in each file)."""
    lps = manifest["layers_per_stage"]
    first = sum(lps[:pp_rank])
    return range(first, first + lps[pp_rank])


def merge_pp(stages: list[dict[str, torch.Tensor]], layers_per_stage: list[int], tied: bool) -> dict[str, torch.Tensor]:
    """Joins the pipeline stages of one tp rank into a pp=1 state: layer numbers become global, and
    the last stage's copy of a tied output layer is dropped (at pp=1 the embedding serves)."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for p, (state, n) in enumerate(zip(stages, layers_per_stage, strict=True)):
        for key, t in state.items():
            m = _LAYER_KEY.match(key)
            if m:
                if int(m.group(1)) >= n:
                    raise ShardsError(f"stage {p}: {key} is beyond its {n} layers", "regenerate the shards")
                out[f"decoder.layers.{offset + int(m.group(1))}.{m.group(2)}"] = t
            elif not (key == "output_layer.weight" and tied and len(stages) > 1):
                out[key] = t
        offset += n
    return out


def split_pp(state: dict[str, torch.Tensor], layers_per_stage: list[int], tied: bool) -> list[dict[str, torch.Tensor]]:
    """The inverse of `merge_pp`, with the converter's placement: embedding on the first stage,
    final norm and output layer on the last, and for tied weights with pp > 1 a copy of the
    embedding as the last stage's output layer."""
    pp = len(layers_per_stage)
    bounds = [sum(layers_per_stage[:p]) for p in range(pp + 1)]
    stages: list[dict[str, torch.Tensor]] = [{} for _ in range(pp)]
    for key, t in state.items():
        m = _LAYER_KEY.match(key)
        if m:
            i = int(m.group(1))
            p = next(q for q in range(pp) if bounds[q] <= i < bounds[q + 1])
            stages[p][f"decoder.layers.{i - bounds[p]}.{m.group(2)}"] = t
        elif key.startswith("embedding."):
            stages[0][key] = t
        else:
            stages[pp - 1][key] = t
    if tied and pp > 1:
        stages[pp - 1]["output_layer.weight"] = state["embedding.word_embeddings.weight"].clone()
    return stages


def write_rank_file(
    out_dir: str, tp_rank: int, pp_rank: int, tensors: dict[str, torch.Tensor], dtype: torch.dtype
) -> str:
    """Writes one rank's safetensors file (temp name, then rename) and returns its name."""
    os.makedirs(out_dir, exist_ok=True)
    name = shard_file_name(tp_rank, pp_rank)
    clean = {
        k: v.detach().to("cpu", dtype).contiguous()
        for k, v in tensors.items()
        if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
    }
    tmp = os.path.join(out_dir, f".{name}.partial")
    save_file(clean, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, name))
    return name


def finalize_shards(
    out_dir: str, src_dir: str, src_manifest: dict[str, Any], extra: dict[str, Any] | None = None
) -> None:
    """Copies tokenizer/ and hf_config.json, recomputes digests, writes the manifest last."""
    same_dir = os.path.realpath(out_dir) == os.path.realpath(src_dir)
    for item in ("tokenizer", "hf_config.json") if not same_dir else ():
        src = os.path.join(src_dir, item)
        dst = os.path.join(out_dir, item)
        if os.path.isdir(src):
            if os.path.exists(dst):
                shutil.rmtree(dst)
            shutil.copytree(src, dst)
        elif os.path.isfile(src):
            shutil.copyfile(src, dst)
    m = {k: v for k, v in src_manifest.items() if not k.startswith("_")}
    files = []
    for e in src_manifest["files"]:
        p = os.path.join(out_dir, e["path"])
        files.append(
            {"tp": e["tp"], "pp": e["pp"], "path": e["path"], "bytes": os.path.getsize(p), "blake3": blake3_file(p)}
        )
    m["files"] = files
    if extra:
        m.update(extra)
    tmp = os.path.join(out_dir, f".{MANIFEST}.partial")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(m, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, MANIFEST))


# What differs between two attempts that train the same model: wall times, memory, and where an
# attempt resumed. The committed output is a function of the stage's inputs alone (so that its
# digest, and every key downstream, is the same on any machine and after a resume); these go to
# the attempt's metrics instead.
ATTEMPT_FIELDS = ("time_s", "tokens_this_attempt", "resumed_from", "resume_load_s", "checkpoint_save_s", "peak_mem_gib")


def write_train_summary(out_dir: str, summary: dict[str, Any], metrics: Any) -> None:
    """Writes train_summary.json without the attempt's own figures, which go to `metrics`."""
    with open(os.path.join(out_dir, "train_summary.json"), "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in summary.items() if k not in ATTEMPT_FIELDS}, f, indent=2)
    attempt = {k: summary[k] for k in ATTEMPT_FIELDS if k in summary}
    if "time_s" in attempt:
        attempt["train_time_s"] = attempt.pop("time_s")
    metrics.write(**attempt)
