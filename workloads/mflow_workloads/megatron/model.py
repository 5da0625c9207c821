"""Megatron-Core's GPTModel as the Megatron engine builds it: the local layer spec, without
Transformer Engine or apex. Core attention runs on torch SDPA and the norms are mflow's own (marked
for Megatron's sequence-parallel gradient reduction); the model is cast to bf16 as a whole, as
Megatron's Float16Module does. Ranks are Megatron's parallel_state layout (rank =
pp_rank*dp*tp + dp_rank*tp + tp_rank, as the reference engine's); stage s holds the layers
`mflow convert --pp` put in its shard, which it loads with load_state_dict(strict=True), and with
tied embeddings the last stage holds a copy of the embedding as its output layer.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import shards as S, training as T
from ..errors import ConfigError, ShardsError
from ..reference import parallel as RP
from . import fusions as MF


def layers_per_stage(num_layers: int, pp: int) -> list[int]:
    """The layers Megatron-Core builds per stage when no custom layout is set (num_layers/pp each,
    contiguous): what `mflow convert --pp` writes, so a stage's shard loads as that stage's model."""
    if pp < 1 or num_layers % pp:
        raise ConfigError(
            f"num_layers {num_layers} is not divisible by pp={pp}",
            "use a pp that divides num_layers (Megatron builds equal stages)",
        )
    return [num_layers // pp] * pp


def check_stage_split(manifest: dict, tp: int, pp: int, where: str = "the shards") -> None:
    """Refuses shards whose tp/pp or layer split differ from what this run's Megatron builds."""
    T.check_shards_layout(manifest, tp, pp, where)
    want = layers_per_stage(S.spec_of(manifest).num_layers, pp)
    if list(manifest["layers_per_stage"]) != want:
        raise ConfigError(
            f"{where} have layers_per_stage {manifest['layers_per_stage']}, Megatron builds {want}",
            "convert the checkpoint with mflow convert --pp (equal stages)",
        )


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
        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
            **_,
        ):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s,b,h,d] -> [b,h,s,d]
            if expand and q.size(1) != k.size(1):
                rep = q.size(1) // k.size(1)
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            with sdpa_kernel(backends, set_priority=True) if cudnn else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=q.size(1) != k.size(1)
                )
            s, b = query.size(0), query.size(1)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    return SDPAAttention


def _compile_rope(on: bool) -> None:
    # Megatron's unfused RoPE (cos, sin, two cats, mul, add) as one compiled kernel per shape, or
    # Megatron's own again.
    from megatron.core.models.common.embeddings import rope_utils

    MF.patch_compiled(rope_utils, "_apply_rotary_pos_emb_bshd", on)


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
                raise ConfigError(
                    f"normalization {config.normalization!r} is not supported", f"use one of {', '.join(fns)}"
                )
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
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.ffn_hidden_size,
        gated_linear_unit=spec.gated_linear_unit,
        activation_func=act,
        normalization=spec.normalization,
        layernorm_epsilon=spec.layernorm_epsilon,
        add_bias_linear=spec.add_bias_linear,
        add_qkv_bias=spec.add_qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=precision == "bf16",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel="seq_parallel" in knobs and tp > 1,
        persist_layer_norm=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion="wgrad_fusion" in knobs,
        bias_activation_fusion="swiglu_fusion" in knobs and spec.gated_linear_unit,
        bias_dropout_fusion=False,
        cross_entropy_loss_fusion="ce_fusion" in knobs,
        cross_entropy_fusion_impl="native",
        use_cpu_initialization=False,
        perform_initialization=False,
    )


def build_model(
    spec: S.ModelSpec, config, tp: int, seq_length: int, attention: str, knobs: set = frozenset(), device="cuda"
):
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
    _compile_rope("compile_rope" in knobs)
    block_spec = TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config), layer_norm=norm)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=spec.padded_vocab_for(tp),
        max_sequence_length=max(seq_length, spec.max_position_embeddings),
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=spec.share_embeddings_and_output_weights,
        position_embedding_type=spec.position_embedding_type,
        rotary_base=int(spec.rotary_base) if float(spec.rotary_base).is_integer() else spec.rotary_base,
        rotary_percent=spec.rotary_percent,
        rope_scaling=spec.rope_scaling,
        rope_scaling_factor=spec.rope_scaling_factor,
    ).to(device)
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
    have = {
        "tp": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
        "dp": dist.get_process_group_ranks(ps.get_data_parallel_group()),
        "pp": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
    }
    if got != want or have != mine:
        raise ConfigError(
            f"rank {rank}: Megatron's parallel_state gives (tp, dp, pp) ranks {got} and groups {have}, "
            f"mflow expects {want} and {mine}",
            "use megatron-core's default rank order tp-cp-ep-dp-pp",
        )


def check_model_stage(model, manifest: dict, pp_rank: int) -> None:
    """The layers Megatron built for this stage are the ones its shard holds (global numbers)."""
    built = [layer.layer_number - 1 for layer in model.decoder.layers]
    want = list(S.stage_layers(manifest, pp_rank))
    if built != want:
        raise ShardsError(
            f"stage {pp_rank}: Megatron built layers {built}, the shard holds {want}",
            "convert the checkpoint with mflow convert --pp (equal stages)",
        )


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
        raise ShardsError(
            f"{shards_dir}/{S.shard_file_name(tp_rank, pp_rank)}: does not match Megatron's "
            f"local-spec GPTModel: {str(e)[:1500]}",
            "convert the checkpoint with the same mflow version and tp/pp as training",
        ) from e
