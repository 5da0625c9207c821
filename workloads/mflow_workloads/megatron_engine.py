"""Training on CUDA with Megatron-Core (local spec, no Transformer Engine or apex).

GPTModel is built from `mflow-checkpoint.json`, each rank loads its shard with
load_state_dict(strict=True), and training runs through Megatron's DDP, optimizer (AdamW with
bf16 params and fp32 main weights, clipping) and get_forward_backward_func (TP, PP, DP). Ranks are
Megatron's parallel_state layout (rank = pp_rank*dp*tp + dp_rank*tp + tp_rank, as the reference
engine's); stage s holds the layers `mflow convert --pp` put in its shard, and with tied
embeddings the last stage holds a copy of the embedding as its output layer, whose gradient
Megatron's finalize_model_grads sums over the embedding group. Data comes from GPTDataset over
the dataset prefixes; dp rank d reads the contiguous slice d of every global batch
(data.first_sample). Checkpoints are torch_dist (dist_checkpointing) under scratch/checkpoints
with the same tracker as the reference engine.

dist_checkpointing.save spawns helper processes, so the entry module must keep its
`if __name__ == "__main__"` guard (mflow_workloads.train has one).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import data as D
from . import megatron_fusions as MF
from . import runtime
from . import shards as S
from .config import TrainConfig
from .errors import ConfigError, ShardsError
from .events import Metrics, Progress, Status
from .flops import flops_per_batch
from .reference import checkpoint as C
from .reference import parallel as RP
from .schedule import lr_at

# Speed knobs, each measured in docs/benchmarks.md (## Training); comma-separated, "none" for none.
DEFAULT_KNOBS = "ce_compiled,swiglu_fusion,fused_adam,compile_rope,cudnn_attn"
KNOBS = {k for k in os.environ.get("MFLOW_MEGATRON_KNOBS", DEFAULT_KNOBS).split(",") if k and k != "none"}


def layers_per_stage(num_layers: int, pp: int) -> list[int]:
    """The layers Megatron-Core builds per stage when no custom layout is set (num_layers/pp each,
    contiguous): what `mflow convert --pp` writes, so a stage's shard loads as that stage's model."""
    if pp < 1 or num_layers % pp:
        raise ConfigError(f"num_layers {num_layers} is not divisible by pp={pp}",
                          "use a pp that divides num_layers (Megatron builds equal stages)")
    return [num_layers // pp] * pp


def check_stage_split(manifest: dict, tp: int, pp: int, where: str = "shards") -> None:
    """Refuses shards whose tp/pp or layer split differ from what this run's Megatron builds."""
    spec = S.spec_of(manifest)
    if manifest["tp"] != tp or manifest["pp"] != pp:
        raise ConfigError(f"{where}: shards have tp={manifest['tp']} pp={manifest['pp']}, the config asks tp={tp} pp={pp}",
                          "convert (or reshard) the checkpoint for the training layout")
    want = layers_per_stage(spec.num_layers, pp)
    if list(manifest["layers_per_stage"]) != want:
        raise ConfigError(f"{where}: shards have layers_per_stage {manifest['layers_per_stage']}, Megatron builds {want}",
                          "convert the checkpoint with mflow convert --pp (equal stages)")


def stage_needs(pp_rank: int, pp: int) -> tuple[bool, bool]:
    """(reads tokens, reads labels): the first stage embeds tokens, the last computes the loss;
    a middle stage reads no data, as in Megatron's pretrain_gpt."""
    return pp_rank == 0, pp_rank == pp - 1


def sdpa_core_attention(knobs: set = frozenset()):
    """A core_attention module on torch SDPA with DotProductAttention's constructor and forward.

    Knobs: `cudnn_attn` puts cuDNN's attention first (falling back to flash), `cudnn_attn_expand`
    also repeats the KV heads, for cuDNN builds that refuse grouped-query inputs."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cudnn = "cudnn_attn" in knobs or "cudnn_attn_expand" in knobs
    expand = "cudnn_attn_expand" in knobs
    backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

    class SDPAAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **_):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s,b,h,d] -> [b,h,s,d]
            if expand and q.size(1) != k.size(1):
                rep = q.size(1) // k.size(1)
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            with sdpa_kernel(backends, set_priority=True) if cudnn else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                     enable_gqa=q.size(1) != k.size(1))
            s, b = query.size(0), query.size(1)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    return SDPAAttention


def _compile_rope() -> None:
    # Megatron's unfused RoPE (cos, sin, two cats, mul, add) as one compiled kernel per shape.
    from megatron.core.models.common.embeddings import rope_utils
    if not getattr(rope_utils, "_mflow_compiled", False):
        rope_utils._apply_rotary_pos_emb_bshd = torch.compile(rope_utils._apply_rotary_pos_emb_bshd, dynamic=False)
        rope_utils._mflow_compiled = True


def _norm_class(knobs: set):
    """Megatron's WrappedTorchNorm without its refusal of sequence parallelism.

    With sequence parallelism each TP rank normalises its slice of the sequence; the weights are
    marked so that Megatron's finalize_model_grads sums their gradients over the TP group.
    `compile_norm` compiles the norm (forward and backward each one fused kernel)."""
    def rms(x, w, b, eps):
        return F.rms_norm(x, (x.size(-1),), w, eps)

    def layer(x, w, b, eps):
        return F.layer_norm(x, (x.size(-1),), w, b, eps)

    fns = {"RMSNorm": rms, "LayerNorm": layer}
    if "compile_norm" in knobs:
        fns = {k: torch.compile(f, dynamic=False) for k, f in fns.items()}

    class Norm(torch.nn.Module):
        def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
            super().__init__()
            if config.normalization not in fns:
                raise ConfigError(f"normalization {config.normalization!r} is not supported",
                                  f"use one of {', '.join(fns)}")
            self.fn, self.eps = fns[config.normalization], eps
            self.weight = torch.nn.Parameter(torch.ones(hidden_size))
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size)) if config.normalization == "LayerNorm" else None
            for p in self.parameters():
                p.sequence_parallel = config.sequence_parallel

        def forward(self, x):
            return self.fn(x, self.weight, self.bias, self.eps)

    return Norm


def transformer_config(spec: S.ModelSpec, tp: int, pp: int, precision: str, knobs: set = frozenset()):
    """`seq_parallel` in knobs turns on Megatron's sequence parallelism when tp > 1 (the caller
    checks that the sequence length divides by tp)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    if spec.activation == "silu":
        act = F.silu
    else:
        from megatron.core.transformer.utils import openai_gelu as act
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups, kv_channels=spec.kv_channels, ffn_hidden_size=spec.ffn_hidden_size,
        gated_linear_unit=spec.gated_linear_unit, activation_func=act, normalization=spec.normalization,
        layernorm_epsilon=spec.layernorm_epsilon, add_bias_linear=spec.add_bias_linear, add_qkv_bias=spec.add_qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=precision == "bf16", params_dtype=dtype, pipeline_dtype=dtype,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel="seq_parallel" in knobs and tp > 1,
        persist_layer_norm=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion="wgrad_fusion" in knobs,
        bias_activation_fusion="swiglu_fusion" in knobs and spec.gated_linear_unit,
        bias_dropout_fusion=False, cross_entropy_loss_fusion="ce_fusion" in knobs,
        cross_entropy_fusion_impl="native", use_cpu_initialization=False, perform_initialization=False)


def build_model(spec: S.ModelSpec, config, tp: int, seq_length: int, attention: str, knobs: set = frozenset(),
                device="cuda"):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer_spec = get_gpt_layer_local_spec(normalization=spec.normalization)
    norm = _norm_class(knobs)
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(layer_spec.submodules, name) is WrappedTorchNorm:
            setattr(layer_spec.submodules, name, norm)
    if attention == "sdpa":
        layer_spec.submodules.self_attention.submodules.core_attention = sdpa_core_attention(knobs)
    if "compile_rope" in knobs:
        _compile_rope()
    block_spec = TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config), layer_norm=norm)
    model = GPTModel(
        config=config, transformer_layer_spec=block_spec, vocab_size=spec.padded_vocab_for(tp),
        max_sequence_length=max(seq_length, spec.max_position_embeddings),
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        parallel_output=True, share_embeddings_and_output_weights=spec.share_embeddings_and_output_weights,
        position_embedding_type=spec.position_embedding_type, rotary_base=int(spec.rotary_base)
        if float(spec.rotary_base).is_integer() else spec.rotary_base,
        rotary_percent=spec.rotary_percent, rope_scaling=spec.rope_scaling,
        rope_scaling_factor=spec.rope_scaling_factor).to(device)
    if "ce_compiled" in knobs:
        MF.use_compiled_cross_entropy(model, ps.get_tensor_model_parallel_group())
    if config.bf16:
        # The norms' parameters are created in fp32 (a LayerNorm would then refuse bf16 input);
        # cast everything, as Megatron's Float16Module does. The optimizer keeps fp32 copies.
        model = model.to(torch.bfloat16)
    return model


def check_megatron_layout(rank: int, tp: int, dp: int, pp: int) -> None:
    """Megatron's parallel_state must give this rank the coordinates and groups the reference
    engine computes (shards, checkpoints and data slices are named by them)."""
    from megatron.core import parallel_state as ps

    got = (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    want = RP.coordinates(rank, tp, dp, pp)
    groups = RP.group_ranks(tp, dp, pp)
    mine = {k: next(g for g in groups[k] if rank in g) for k in ("tp", "dp", "pp")}
    have = {"tp": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
            "dp": dist.get_process_group_ranks(ps.get_data_parallel_group()),
            "pp": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())}
    if got != want or have != mine:
        raise ConfigError(f"rank {rank}: Megatron's parallel_state gives (tp, dp, pp) ranks {got} and groups {have}, "
                          f"mflow expects {want} and {mine}", "use megatron-core's default rank order tp-cp-ep-dp-pp")


def check_model_stage(model, manifest: dict, pp_rank: int) -> None:
    """The layers Megatron built for this stage are the ones its shard holds (global numbers)."""
    built = [layer.layer_number - 1 for layer in model.decoder.layers]
    want = list(S.stage_layers(manifest, pp_rank))
    if built != want:
        raise ShardsError(f"stage {pp_rank}: Megatron built layers {built}, the shard holds {want}",
                          "convert the checkpoint with mflow convert --pp (equal stages)")


def sync_tied_embedding(model, spec: S.ModelSpec, pp: int) -> None:
    """Makes the last stage's copy of a tied embedding the first stage's, as Megatron does at
    build time (zero, then sum over the embedding group); the shards hold equal copies already."""
    from megatron.core import parallel_state as ps

    if pp == 1 or not spec.share_embeddings_and_output_weights or not ps.is_rank_in_embedding_group():
        return
    w = model.shared_embedding_or_output_weight()
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            w.zero_()
        dist.all_reduce(w.data, group=ps.get_embedding_group())


def load_shard(model, shards_dir: str, manifest: dict, tp_rank: int, pp_rank: int) -> None:
    state = S.load_rank(shards_dir, manifest, tp_rank, pp_rank)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ShardsError(f"{shards_dir}/{S.shard_file_name(tp_rank, pp_rank)}: does not match Megatron's "
                          f"local-spec GPTModel: {str(e)[:1500]}",
                          "convert the checkpoint with the same mflow version and tp/pp as training") from e


class MinimalTokenizer:
    """What GPTDataset reads from a tokenizer: vocab size and the end-of-document id."""

    def __init__(self, vocab_size: int, eod: int):
        self.vocab_size, self.eod = vocab_size, eod
        self.unique_identifiers = {"class": "mflow", "vocab_size": vocab_size, "eod": eod}


def build_datasets(cfg: TrainConfig, meta: dict, dp: int):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    dcfg = GPTDatasetConfig(
        random_seed=cfg.seed, sequence_length=cfg.seq_length,
        blend_per_split=[([os.path.join(cfg.data, "train")], None), ([os.path.join(cfg.data, "valid")], None), None],
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
        tokenizer=MinimalTokenizer(meta["vocab_size"], meta["eod_id"]),
        path_to_cache=os.path.join(cfg.scratch, "dataset_cache"), mid_level_dataset_surplus=0.005)
    sizes = [cfg.iterations * cfg.global_batch_size, cfg.eval_iters * cfg.global_batch_size, None]
    train_ds, valid_ds, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, dcfg).build()
    return train_ds, valid_ds


def batches(ds, dp: int, dp_rank: int, gbs: int, mbs: int, start_iter: int, pp_rank: int = 0, pp: int = 1,
            device="cuda"):
    """Micro-batches of one data-parallel rank from global iteration `start_iter` on: the samples
    of data.first_sample, which the reference engine reads too. Each stage gets only what it uses
    (stage_needs); a middle stage's micro-batches are empty, but still one per schedule step."""
    tokens, labels = stage_needs(pp_rank, pp)
    keys = (("tokens", "position_ids") if tokens else ()) + (("labels", "loss_mask") if labels else ())
    it = start_iter
    while True:
        for m in range(gbs // (mbs * dp)):
            first = D.first_sample(it, m, gbs, mbs, dp, dp_rank)
            items = [ds[first + i] for i in range(mbs)] if keys else []
            yield {k: torch.stack([x[k] for x in items]).to(device, non_blocking=True) for k in keys}
        it += 1


def forward_step(data_iterator, model):
    b = next(data_iterator)
    # Stages after the first take their input from the previous stage (the schedule sets it).
    out = model(b.get("tokens"), b.get("position_ids"), None, labels=b.get("labels"))
    if "loss_mask" not in b:  # not the last stage: `out` is the hidden state sent on
        return out, None
    mask = b["loss_mask"].float()

    def loss_func(output_tensor):
        loss = (output_tensor.float() * mask).sum() / mask.sum().clamp(min=1)
        # A copy: the schedule divides the returned loss by num_microbatches in place, which a
        # detach() (same storage) would report too.
        return loss, {"lm loss": loss.detach().clone()}

    return out, loss_func


def _encode(obj, path, tensors):
    """Optimizer state -> JSON skeleton plus named tensors (safetensors), so no pickle is involved."""
    from .errors import CheckpointError

    if isinstance(obj, torch.Tensor):
        key = "/".join(path)
        tensors[key] = obj.detach().cpu().contiguous()
        return {"t": key}
    if isinstance(obj, dict):
        return {"d": [[k, _encode(v, path + [str(k)], tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"l": [_encode(v, path + [str(i)], tensors) for i, v in enumerate(obj)], "tuple": isinstance(obj, tuple)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"v": obj}
    raise CheckpointError(f"optimizer state at {'/'.join(path)} holds a {type(obj).__name__}",
                          "only tensors and plain values can be checkpointed")


def _decode(node, tensors, device):
    if "t" in node:
        t = tensors[node["t"]]
        return t if t.ndim == 0 and t.device.type == "cpu" and t.dtype == torch.float32 else t.to(device)
    if "d" in node:
        return {k: _decode(v, tensors, device) for k, v in node["d"]}
    if "l" in node:
        items = [_decode(v, tensors, device) for v in node["l"]]
        return tuple(items) if node["tuple"] else items
    return node["v"]


def save_optimizer(opt, directory: str, tp_rank: int, pp_rank: int) -> None:
    from safetensors.torch import save_file

    tensors = {}
    skeleton = _encode(opt.state_dict(), [], tensors)
    stem = os.path.join(directory, f"optim_tp{tp_rank:02}_pp{pp_rank:03}")
    save_file(tensors, stem + ".safetensors")
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(skeleton, f)


def load_optimizer(opt, directory: str, tp_rank: int, pp_rank: int) -> None:
    from safetensors.torch import load_file

    stem = os.path.join(directory, f"optim_tp{tp_rank:02}_pp{pp_rank:03}")
    tensors = load_file(stem + ".safetensors")
    with open(stem + ".json", encoding="utf-8") as f:
        skeleton = json.load(f)
    opt.load_state_dict(_decode(skeleton, tensors, torch.device("cuda", torch.cuda.current_device())))


def save_checkpoint(root: str, iteration: int, model, opt, meta: dict) -> float:
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    rank = dist.get_rank()
    tmp = os.path.join(root, f".tmp_iter_{iteration:07d}")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "model"))
    dist.barrier()
    # Model weights as torch_dist (resharding-capable); the optimizer per (tp, pp) rank as safetensors.
    # The unwrapped GPTModel: Megatron's DDP would prefix every key with "module.".
    dist_checkpointing.save(getattr(model, "module", model).sharded_state_dict(prefix=""), os.path.join(tmp, "model"))
    from megatron.core import parallel_state as ps
    if ps.get_data_parallel_rank() == 0:
        save_optimizer(opt, tmp, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state()}
    rng.update({f"tracker/{k}": v for k, v in get_cuda_rng_tracker().get_states().items()})
    save_file(rng, os.path.join(tmp, f"rng_rank{rank:05}.safetensors"))
    dist.barrier()
    if rank == 0:
        with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
            json.dump({**meta, "iteration": iteration, "engine": "megatron"}, f)
        final = C.iter_dir(root, iteration)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        tracker_tmp = os.path.join(root, f".{C.TRACKER}.tmp")
        with open(tracker_tmp, "w", encoding="utf-8") as f:
            f.write(str(iteration))
        os.replace(tracker_tmp, os.path.join(root, C.TRACKER))
        C.prune(root)
    dist.barrier()
    return time.perf_counter() - t0


def load_checkpoint(root: str, iteration: int, model, opt, tp: int, pp: int) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from safetensors import safe_open

    d = C.iter_dir(root, iteration)
    with open(os.path.join(d, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("engine") != "megatron":
        raise ConfigError(f"{d}: written by the {meta.get('engine', 'reference')} engine",
                          "resume with the same engine, or clear the scratch directory")
    from megatron.core import parallel_state as ps
    inner = getattr(model, "module", model)
    state = dist_checkpointing.load(inner.sharded_state_dict(prefix=""), os.path.join(d, "model"))
    result = inner.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise ConfigError(f"{d}: checkpoint lacks {', '.join(missing[:5])}", "clear the scratch directory to start over")
    if meta.get("tp") != tp or meta.get("pp") != pp:
        raise ConfigError(f"{d}: saved with tp={meta.get('tp')} pp={meta.get('pp')}, this run has tp={tp} pp={pp}",
                          "resume with the same layout, or clear the scratch directory")
    load_optimizer(opt, d, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    rng_path = os.path.join(d, f"rng_rank{dist.get_rank():05}.safetensors")
    if os.path.exists(rng_path):
        with safe_open(rng_path, framework="pt") as f:
            torch.set_rng_state(f.get_tensor("cpu"))
            torch.cuda.set_rng_state(f.get_tensor("cuda"))
            get_cuda_rng_tracker().set_states({k[len("tracker/"):]: f.get_tensor(k) for k in f.keys()
                                               if k.startswith("tracker/")})
    return meta


def _enable_fused_adamw() -> None:
    # Without TE/apex Megatron uses torch.optim.AdamW (foreach); the fused CUDA kernel is a drop-in.
    base = torch.optim.AdamW

    class FusedAdamW(base):
        def __init__(self, params, **kw):
            kw.setdefault("fused", True)
            super().__init__(params, **kw)

    torch.optim.AdamW = FusedAdamW


def train(cfg: TrainConfig) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not torch.cuda.is_available():
        raise ConfigError("engine 'megatron' needs CUDA, and no GPU is visible", "use engine 'reference' on CPU")
    runtime.init_distributed(True)
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp)
    model_parallel_cuda_manual_seed(cfg.seed)
    rank = dist.get_rank()
    tp_rank, pp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
    is_main = rank == 0
    status, metrics = Status(is_main), Metrics(is_main)
    progress = Progress("train", cfg.iterations, "it", is_main)
    manifest = S.read_manifest(cfg.shards)
    spec = S.spec_of(manifest)
    check_stage_split(manifest, cfg.tp, cfg.pp, cfg.shards)
    check_megatron_layout(rank, cfg.tp, cfg.dp, cfg.pp)
    meta = D.read_dataset_json(cfg.data)
    # Sequence parallelism splits the sequence over the TP ranks.
    knobs = KNOBS if cfg.seq_length % cfg.tp == 0 else KNOBS - {"seq_parallel"}
    if "fused_adam" in knobs:
        _enable_fused_adamw()
    if "wgrad_fusion" in knobs:
        MF.enable_wgrad_fusion()

    config = transformer_config(spec, cfg.tp, cfg.pp, cfg.precision, knobs)
    model = build_model(spec, config, cfg.tp, cfg.seq_length, cfg.attention, knobs)
    check_model_stage(model, manifest, pp_rank)
    load_shard(model, cfg.shards, manifest, tp_rank, pp_rank)
    sync_tied_embedding(model, spec, cfg.pp)
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32="bf16_grads" not in knobs, overlap_grad_reduce=False, use_distributed_optimizer=False),
        module=model)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2, adam_eps=1e-8, clip_grad=cfg.clip_grad, bf16=cfg.precision == "bf16",
        params_dtype=config.params_dtype, use_distributed_optimizer=False), [ddp])
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = opt.scale_loss

    if is_main:
        os.makedirs(cfg.scratch, exist_ok=True)
    dist.barrier()
    train_ds, valid_ds = build_datasets(cfg, meta, cfg.dp)
    ckroot = os.path.join(cfg.scratch, "checkpoints")
    if is_main and os.path.isdir(ckroot):
        C.prune(ckroot)
    dist.barrier()
    start = C.latest(ckroot)
    resumed_from, resume_s = None, None
    if start is not None:
        t0 = time.perf_counter()
        load_checkpoint(ckroot, start, ddp, opt, cfg.tp, cfg.pp)
        resume_s = time.perf_counter() - t0
        resumed_from = start
        if is_main:
            print(f"[mflow] resumed from checkpoint at iteration {start} in {resume_s:.1f}s", flush=True)
    start = start or 0
    status.update(checkpoint_iteration=resumed_from, resumed_from=resumed_from)

    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("flag", True))
    data_iter = batches(train_ds, cfg.dp, dp_rank, cfg.global_batch_size, cfg.micro_batch_size, start, pp_rank, cfg.pp)
    fb = get_forward_backward_func()
    if "cuda_graph" in knobs:
        fb = MF.full_iteration_graph(fb)
    flops = flops_per_batch(spec, cfg.global_batch_size, cfg.seq_length, spec.padded_vocab_for(cfg.tp))
    last_stage = ps.is_pipeline_last_stage()
    # The loss exists on the last stage only, identical over its tp ranks: the world sum of the
    # last stage's values over tp*dp is the mean over the dp replicas, on every rank (rank 0 logs).
    n_loss_ranks = cfg.tp * cfg.dp
    first_val = last_val = None
    loss_value = float("nan")
    save_times = []
    t_start = time.perf_counter()
    torch.cuda.reset_peak_memory_stats()

    def reduce_loss(losses) -> float:
        v = torch.tensor(sum(float(x["lm loss"]) for x in losses) / max(len(losses), 1) if last_stage and losses else 0.0,
                         device="cuda", dtype=torch.float64)
        dist.all_reduce(v)
        return float(v) / n_loss_ranks

    def run_eval() -> float:
        ddp.eval()
        it = batches(valid_ds, cfg.dp, dp_rank, cfg.global_batch_size, cfg.micro_batch_size, 0, pp_rank, cfg.pp)
        vals = []
        with torch.no_grad():
            for _ in range(cfg.eval_iters):
                losses = fb(forward_step_func=forward_step, data_iterator=it, model=[ddp],
                            num_microbatches=cfg.num_microbatches, seq_length=cfg.seq_length,
                            micro_batch_size=cfg.micro_batch_size, decoder_seq_length=cfg.seq_length, forward_only=True)
                vals.append(reduce_loss(losses))
        ddp.train()
        return sum(vals) / len(vals)

    for it in range(start, cfg.iterations):
        t0 = time.perf_counter()
        lr = lr_at(it, cfg.lr, cfg.min_lr, cfg.warmup_iterations, cfg.iterations, cfg.lr_decay)
        for g in opt.param_groups:
            g["lr"] = lr
        ddp.zero_grad_buffer()
        opt.zero_grad()
        losses = fb(forward_step_func=forward_step, data_iterator=data_iter, model=[ddp],
                    num_microbatches=cfg.num_microbatches, seq_length=cfg.seq_length,
                    micro_batch_size=cfg.micro_batch_size, decoder_seq_length=cfg.seq_length, forward_only=False)
        ok, grad_norm, _ = opt.step()
        loss_value = reduce_loss(losses)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        done = it + 1
        if done % cfg.log_interval == 0 or done == cfg.iterations:
            # Peak memory of the fullest rank (stages differ: the last holds the logits).
            mem = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
            if cfg.pp * cfg.dp * cfg.tp > 1:
                dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            # The whole job's tokens per second; FLOP/s per GPU over all tp*pp*dp GPUs.
            if is_main:
                metrics.write(iteration=done, loss=loss_value, lr=lr, grad_norm=float(grad_norm or 0.0),
                              tokens_per_s=cfg.global_batch_size * cfg.seq_length / dt,
                              tflops_per_gpu=flops / (dt * 1e12 * dist.get_world_size()),
                              mem_gib=float(mem), time_s=dt)
        progress.update(done, f"loss {loss_value:.4f} lr {lr:.3g}", force=done == cfg.iterations)
        if done % cfg.eval_interval == 0 or done == cfg.iterations:
            val = run_eval()
            first_val = val if first_val is None else first_val
            last_val = val
            if is_main:
                metrics.write(iteration=done, val_loss=val, val_ppl=math.exp(min(val, 700)))
        flag = torch.tensor([1.0 if stop["flag"] else 0.0], device="cuda")
        dist.all_reduce(flag)
        if done % cfg.save_interval == 0 or done == cfg.iterations or flag.item() > 0:
            save_times.append(save_checkpoint(ckroot, done, ddp, opt, {
                "consumed_samples": done * cfg.global_batch_size, "seed": cfg.seed, "tp": cfg.tp, "pp": cfg.pp,
                "dp": cfg.dp}))
            status.update(checkpoint_iteration=done)
            if is_main:
                print(f"[mflow] checkpoint at iteration {done} saved in {save_times[-1]:.1f}s", flush=True)
        if flag.item() > 0:
            raise InterruptedError(f"terminated by SIGTERM; checkpoint saved at iteration {done}")

    train_time = time.perf_counter() - t_start
    if dp_rank == 0:
        S.write_rank_file(cfg.output, tp_rank, pp_rank, model.state_dict(), S.DTYPES[manifest["dtype"]])
    from megatron.core import dist_checkpointing
    final_dir = os.path.join(cfg.output, "megatron")
    if is_main:
        os.makedirs(final_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(prefix=""), final_dir)
    dist.barrier()
    summary = {"engine": "megatron", "iterations": cfg.iterations, "final_loss": loss_value,
               "first_val_loss": first_val, "last_val_loss": last_val,
               "tokens": cfg.iterations * cfg.global_batch_size * cfg.seq_length, "time_s": train_time,
               "resumed_from": resumed_from, "resume_load_s": resume_s, "checkpoint_save_s": save_times,
               "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "tp": cfg.tp, "pp": cfg.pp, "dp": cfg.dp,
               "knobs": sorted(knobs)}
    if is_main:
        S.finalize_shards(cfg.output, cfg.shards, manifest)
        S.write_train_summary(cfg.output, summary, metrics)
    dist.barrier()
    return summary
