"""Speed pieces for the Megatron engine that Transformer Engine and apex would otherwise provide.

- `cross_entropy`: vocab-parallel cross-entropy as three compiled kernels (row max; sum of exp and
  the target's logit; the gradient), reading the bf16 logits and keeping only them for backward.
  Megatron's native fused version makes an fp32 copy of the logits, rewrites it in place four
  times and keeps it (twice the bytes) until backward.
- `enable_wgrad_fusion`: Megatron's gradient-accumulation fusion (the weight-gradient GEMM adds
  straight into the fp32 main_grad) through torch's addmm with an fp32 output, in place of apex's
  fused_weight_gradient_mlp_cuda.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _row_max(x):
    return x.float().amax(dim=-1)


def _sum_exp_and_target(x, m, t):
    # t is the target's index in this rank's vocab slice, -1 where another rank holds it.
    xf = x.float()
    s = torch.exp(xf - m.unsqueeze(-1)).sum(dim=-1)
    picked = xf.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return s, torch.where(t >= 0, picked, torch.zeros_like(picked))


def _grad(x, t, lse, g):
    p = torch.exp(x.float() - lse.unsqueeze(-1))
    hit = torch.arange(x.size(-1), device=x.device) == t.unsqueeze(-1)
    return ((p - hit.to(p.dtype)) * g.unsqueeze(-1)).to(x.dtype)


_compiled = {}


def _kernel(fn, cuda: bool):
    # Compiled on CUDA only (one kernel each, shapes fixed per run); eager elsewhere.
    if not cuda:
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=False)
    return _compiled[fn]


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        cuda = logits.is_cuda
        size = dist.get_world_size(group) if group is not None else 1
        m = _kernel(_row_max, cuda)(logits)
        if size > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        vocab = logits.size(-1)
        start = dist.get_rank(group) * vocab if size > 1 else 0
        t = target - start
        t = torch.where((t >= 0) & (t < vocab), t, torch.full_like(t, -1))
        s, picked = _kernel(_sum_exp_and_target, cuda)(logits, m, t)
        if size > 1:
            both = torch.stack([s, picked])
            dist.all_reduce(both, group=group)
            s, picked = both[0], both[1]
        lse = torch.log(s) + m
        ctx.save_for_backward(logits, t, lse)
        return lse - picked

    @staticmethod
    def backward(ctx, grad_out):
        logits, t, lse = ctx.saved_tensors
        return _kernel(_grad, logits.is_cuda)(logits, t, lse, grad_out.contiguous()), None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None) -> torch.Tensor:
    """Per-token loss [s, b] of vocab-parallel logits [s, b, v/tp] against global targets [s, b]."""
    return _CrossEntropy.apply(logits, target, group)


def use_compiled_cross_entropy(model, group) -> None:
    """Makes the GPTModel compute its loss with `cross_entropy` (labels [b, s] -> loss [b, s])."""

    def loss(labels, logits):
        return cross_entropy(logits, labels.transpose(0, 1).contiguous(), group).transpose(0, 1).contiguous()

    model.compute_language_model_loss = loss


class _WgradAccumulate:
    """What Megatron calls in apex's fused_weight_gradient_mlp_cuda: main_grad += dY^T X."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        torch.ops.aten.addmm.dtype_out(main_grad, grad_output.t(), total_input, torch.float32, out=main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input, grad_output, main_grad):
        main_grad.addmm_(grad_output.t(), total_input)


def enable_wgrad_fusion() -> None:
    """Lets TransformerConfig(gradient_accumulation_fusion=True) build without apex; call it
    before the model is built."""
    from megatron.core.tensor_parallel import layers

    layers.fused_weight_gradient_mlp_cuda = _WgradAccumulate
    layers._grad_accum_fusion_available = True
