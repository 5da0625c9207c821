"""Speed pieces for the Megatron engine that Transformer Engine and apex would otherwise provide.

- `cross_entropy`: vocab-parallel cross-entropy as three compiled kernels (row max; sum of exp and
  the target's logit; the gradient), reading the bf16 logits and keeping only them for backward.
  Megatron's native fused version makes an fp32 copy of the logits, rewrites it in place four
  times and keeps it (twice the bytes) until backward.
- `enable_fused_adamw`: torch's AdamW with its fused CUDA kernel, where Megatron would take the
  foreach one.
- `enable_wgrad_fusion`: Megatron's gradient-accumulation fusion (the weight-gradient GEMM adds
  straight into the fp32 main_grad) through torch's addmm with an fp32 output, in place of apex's
  fused_weight_gradient_mlp_cuda.
- `enable_foreach_optimizer`: apex's multi-tensor ops for Megatron's optimizer on torch's foreach
  kernels. Megatron's own fallback reads every gradient's norm back to the host one by one (a
  wait on the GPU per parameter) and scales or copies each tensor with two kernels and an fp32
  temporary; these read the total norm once and scale or copy all tensors in a few kernels.
- `enable_swiglu_backward`: SwiGLU's backward as one Triton kernel that reads the input and the
  output gradient once and writes both halves of the input gradient; the forward stays Megatron's.
"""

from __future__ import annotations

import functools

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


_MISSING = object()
_originals = {}


def _original(module, name: str):
    # module.name as it was before mflow first patched it (_MISSING if it was absent).
    return _originals.setdefault((module.__name__, name), getattr(module, name, _MISSING))


def _patch(module, name: str, value, on: bool) -> None:
    # Sets module.name to value, or back to what it was before mflow first patched it (absent
    # again if it was absent): knobs set per process can be turned off again, as the bench does.
    original = _original(module, name)
    if on:
        setattr(module, name, value)
    elif original is not _MISSING:
        setattr(module, name, original)
    elif hasattr(module, name):
        delattr(module, name)


def patch_compiled(module, name: str, on: bool) -> None:
    """module.name through torch.compile (compiled once, from the original), or the original."""
    _patch(module, name, _kernel(_original(module, name), True) if on else None, on)


class _WgradAccumulate:
    """What Megatron calls in apex's fused_weight_gradient_mlp_cuda: main_grad += dY^T X."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        torch.ops.aten.addmm.dtype_out(main_grad, grad_output.t(), total_input, torch.float32, out=main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input, grad_output, main_grad):
        main_grad.addmm_(grad_output.t(), total_input)


def enable_wgrad_fusion(on: bool = True) -> None:
    """Lets TransformerConfig(gradient_accumulation_fusion=True) build without apex (or not, with
    on=False); call it before the model is built."""
    from megatron.core.tensor_parallel import layers

    _patch(layers, "fused_weight_gradient_mlp_cuda", _WgradAccumulate, on)
    _patch(layers, "_grad_accum_fusion_available", True, on)


class _FusedAdamW(torch.optim.AdamW):
    # Made when this module is imported, before any patch: a subclass of torch's own AdamW.
    def __init__(self, params, **kw):
        kw.setdefault("fused", True)
        super().__init__(params, **kw)


def enable_fused_adamw(on: bool = True) -> None:
    """Without TE/apex Megatron builds torch.optim.AdamW (foreach), looked up when the optimizer
    is made; this puts the fused kernel in its place (or back, with on=False)."""
    _patch(torch.optim, "AdamW", _FusedAdamW, on)


def _l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    # The total norm of the tensors of tensor_lists[0], as a one-element fp32 tensor on their device.
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1).float(), None


def _scale(chunk_size, noop_flag, tensor_lists, scale: float):
    # dst = src * scale for every pair; a scale of 1.0 is Megatron's main -> model weight copy.
    src, dst = tensor_lists
    if scale == 1.0:
        torch._foreach_copy_(dst, src)
    elif all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def enable_foreach_optimizer(on: bool = True) -> None:
    """Gives Megatron's clipping and optimizer the ops above in place of its local fallbacks (or
    back, with on=False). The total norm is still read once (Megatron clips only when it is
    above the limit), not once per parameter."""
    from megatron.core.optimizer import clip_grads, optimizer

    _patch(clip_grads, "l2_norm_impl", _l2_norm, on)
    _patch(clip_grads, "multi_tensor_scale_impl", _scale, on)
    _patch(optimizer, "multi_tensor_scale_impl", _scale, on)


@functools.cache
def _swiglu_backward_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(g_ptr, x_ptr, dx_ptr, n_cols, BLOCK: tl.constexpr):
        # One block of one row: x = [a | b] (2 * n_cols), g and the output of forward n_cols wide.
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < n_cols
        x_row = x_ptr + row * 2 * n_cols + col
        a = tl.load(x_row, mask=mask).to(tl.float32)
        b = tl.load(x_row + n_cols, mask=mask).to(tl.float32)
        g = tl.load(g_ptr + row * n_cols + col, mask=mask).to(tl.float32)
        s = tl.sigmoid(a)
        # Megatron's swiglu_back, term for term: d/da silu(a) * b and silu(a).
        da = g * s * (1 + a * (1 - s)) * b
        db = g * (a * s)
        dx_row = dx_ptr + row * 2 * n_cols + col
        tl.store(dx_row, da.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_row + n_cols, db.to(dx_ptr.dtype.element_ty), mask=mask)

    return kernel


_SWIGLU_BLOCK = 1024


def swiglu_backward(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The gradient of SwiGLU's input x = [a | b] (rows of 2n) for the output gradient g (rows of n)."""
    g, x = g.contiguous(), x.contiguous()
    n = g.size(-1)
    dx = torch.empty_like(x)
    rows = x.numel() // (2 * n)
    grid = (rows, (n + _SWIGLU_BLOCK - 1) // _SWIGLU_BLOCK)
    _swiglu_backward_kernel()[grid](g, x, dx, n, BLOCK=_SWIGLU_BLOCK, num_warps=4)
    return dx


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        from megatron.core.fusions.fused_bias_swiglu import swiglu

        ctx.save_for_backward(x)
        return swiglu(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return swiglu_backward(g, x)


def enable_swiglu_backward(on: bool = True) -> None:
    """Makes Megatron's MLP (bias_activation_fusion, no bias, no fp8 input store) use _SwiGLU on
    CUDA, everything else keeping Megatron's own (or back, with on=False)."""
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.transformer import mlp

    megatrons = fused_bias_swiglu.bias_swiglu_impl

    def bias_swiglu_impl(x, bias, fp8_input_store=False, cpu_offload_input=False):
        if bias is not None or fp8_input_store or cpu_offload_input or not x.is_cuda:
            return megatrons(x, bias, fp8_input_store, cpu_offload_input)
        shape = x.shape
        return _SwiGLU.apply(x.view(-1, shape[-1])).view(*shape[:-1], -1)

    _patch(mlp, "bias_swiglu_impl", bias_swiglu_impl, on)
