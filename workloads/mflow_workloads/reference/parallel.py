"""Process groups and the conjugate tensor-parallel operators (Megatron's f and g).

Ranks are laid out as Megatron does with pp=1: rank = dp_rank * tp + tp_rank, so the tp ranks
of one model replica are neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ParallelError


@dataclass
class Parallel:
    tp: int = 1
    dp: int = 1
    rank: int = 0
    tp_rank: int = 0
    dp_rank: int = 0
    tp_group: object = None
    dp_group: object = None

    @property
    def world(self) -> int:
        return self.tp * self.dp


def single() -> Parallel:
    """A one-process layout that needs no process group."""
    return Parallel()


def setup(tp: int, dp: int, pp: int = 1) -> Parallel:
    """Creates tp and dp groups over the already initialised default group."""
    if pp != 1:
        raise ParallelError(f"pp={pp}: the reference engine supports tensor and data parallelism only",
                            "set pp = 1, or use the megatron engine on CUDA for pipeline parallelism")
    world = dist.get_world_size()
    if world != tp * dp:
        raise ParallelError(f"launched world size {world} != tp*pp*dp = {tp}*{pp}*{dp}",
                            "launch tp*pp*dp processes (nnodes * nproc_per_node)")
    rank = dist.get_rank()
    p = Parallel(tp=tp, dp=dp, rank=rank, tp_rank=rank % tp, dp_rank=rank // tp)
    for d in range(dp):  # every rank must take part in creating every group
        g = dist.new_group(list(range(d * tp, (d + 1) * tp)))
        if d == p.dp_rank:
            p.tp_group = g
    for t in range(tp):
        g = dist.new_group(list(range(t, world, tp)))
        if t == p.tp_rank:
            p.dp_group = g
    return p


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, op=op, group=group)
    return x


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward (input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward (output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward, keep own slice backward."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.rank, ctx.size = rank, size
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None, None, None


def copy_to_tp(x: torch.Tensor, p: Parallel) -> torch.Tensor:
    return x if p.tp == 1 else _CopyToTP.apply(x, p.tp_group)


def reduce_from_tp(x: torch.Tensor, p: Parallel) -> torch.Tensor:
    return x if p.tp == 1 else _ReduceFromTP.apply(x, p.tp_group)


def gather_from_tp(x: torch.Tensor, p: Parallel) -> torch.Tensor:
    return x if p.tp == 1 else _GatherFromTP.apply(x, p.tp_group, p.tp_rank, p.tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocab-sharded logits without gathering them (as Megatron does)."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        logits = logits.float()
        local_max = logits.max(dim=-1)[0]
        if group is not None:
            dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        vocab_local = logits.shape[-1]
        in_range = (target >= vocab_start) & (target < vocab_start + vocab_local)
        local_target = (target - vocab_start).clamp(0, vocab_local - 1)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * in_range
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if group is not None:
            both = torch.stack([predicted, sum_exp])
            dist.all_reduce(both, group=group)
            predicted, sum_exp = both[0], both[1]
        loss = sum_exp.log() - predicted
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, in_range, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, in_range, local_target = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -in_range.unsqueeze(-1).to(grad.dtype))
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, p: Parallel) -> torch.Tensor:
    """Per-token loss [b, s] from local logits [b, s, Vp/tp]."""
    start = p.tp_rank * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, start, p.tp_group if p.tp > 1 else None)
