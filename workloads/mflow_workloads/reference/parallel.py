"""Process groups and the conjugate tensor-parallel operators (Megatron's f and g).

Ranks are laid out as Megatron-Core lays them out by default (parallel_state's order
"tp-cp-ep-dp-pp"): its RankGenerator gives the first name of the order the smallest stride, so
with cp = ep = 1, rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank. The tp ranks of one model
replica are neighbours (one node, fast links), and a rank has the same coordinates under both of
mflow's engines, so shards and checkpoints of a rank mean the same thing in either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import ParallelError
from . import shm


@dataclass
class Parallel:
    tp: int = 1
    dp: int = 1
    rank: int = 0
    tp_rank: int = 0
    dp_rank: int = 0
    tp_group: object = None
    dp_group: object = None
    pp: int = 1
    pp_rank: int = 0
    pp_group: object = None
    # tp x pp ranks of one replica (Megatron's model-parallel group): the grad norm is summed here.
    mp_group: object = None
    # First and last stage of this rank's pipeline, which both hold the tied embedding.
    embedding_group: object = None
    embedding_ranks: list = field(default_factory=list)
    # Shared-memory all-reduce of a two-rank tp group on one host (gloo ranks only), else None.
    tp_shm: object = None

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_rank(self) -> int:
        return self.rank - self.tp * self.dp

    @property
    def next_rank(self) -> int:
        return self.rank + self.tp * self.dp


def single() -> Parallel:
    """A one-process layout that needs no process group."""
    return Parallel()


def coordinates(rank: int, tp: int, dp: int, pp: int) -> tuple[int, int, int]:
    """(tp_rank, dp_rank, pp_rank) of a global rank."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def group_ranks(tp: int, dp: int, pp: int) -> dict[str, list[list[int]]]:
    """Every group of each kind, as lists of global ranks, in the order they are created."""

    def r(t: int, d: int, s: int) -> int:
        return s * dp * tp + d * tp + t

    pipelines = [[r(t, d, s) for s in range(pp)] for d in range(dp) for t in range(tp)]
    return {
        "tp": [[r(t, d, s) for t in range(tp)] for s in range(pp) for d in range(dp)],
        "dp": [[r(t, d, s) for d in range(dp)] for s in range(pp) for t in range(tp)],
        "pp": pipelines,
        "mp": [sorted(r(t, d, s) for s in range(pp) for t in range(tp)) for d in range(dp)],
        "embedding": [[q[0], q[-1]] for q in pipelines],
    }


def setup(tp: int, dp: int, pp: int = 1) -> Parallel:
    """Creates the tp, dp and (for pp > 1) pipeline, model-parallel and embedding groups over the
    already initialised default group."""
    world = dist.get_world_size()
    if world != tp * pp * dp:
        raise ParallelError(
            f"launched world size {world} != tp*pp*dp = {tp}*{pp}*{dp}",
            "launch tp*pp*dp processes (nnodes * nproc_per_node)",
        )
    rank = dist.get_rank()
    t, d, s = coordinates(rank, tp, dp, pp)
    p = Parallel(tp=tp, dp=dp, pp=pp, rank=rank, tp_rank=t, dp_rank=d, pp_rank=s)
    groups = group_ranks(tp, dp, pp)
    kinds = ("tp", "dp") + (("pp", "mp", "embedding") if pp > 1 else ())
    for kind in kinds:
        for ranks in groups[kind]:  # every rank must take part in creating every group
            g = dist.new_group(ranks)
            if rank in ranks:
                setattr(p, f"{kind}_group", g)
                if kind == "embedding":
                    p.embedding_ranks = ranks
    if pp == 1:
        p.mp_group = p.tp_group
    if tp == 2 and dist.get_backend() == "gloo":
        p.tp_shm = shm.connect(p.tp_group, groups["tp"][rank // tp], rank)
    return p


def tp_all_reduce(x: torch.Tensor, p: Parallel, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or max) of `x` over the tp group, as a new tensor; `x` is left as it is."""
    if p.tp_shm is not None and p.tp_shm.fits(x):
        return p.tp_shm.all_reduce(x.contiguous(), op)
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, op=op, group=p.tp_group)
    return x


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward (input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, p):
        ctx.p = p
        return x

    @staticmethod
    def backward(ctx, grad):
        return tp_all_reduce(grad, ctx.p), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward (output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x, p):
        return tp_all_reduce(x, p)

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
    return x if p.tp == 1 else _CopyToTP.apply(x, p)


def reduce_from_tp(x: torch.Tensor, p: Parallel) -> torch.Tensor:
    return x if p.tp == 1 else _ReduceFromTP.apply(x, p)


def gather_from_tp(x: torch.Tensor, p: Parallel) -> torch.Tensor:
    return x if p.tp == 1 else _GatherFromTP.apply(x, p.tp_group, p.tp_rank, p.tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocab-sharded logits without gathering them (as Megatron does)."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, p):
        logits = logits.float()
        local_max = logits.max(dim=-1)[0]
        if p is not None:
            local_max = tp_all_reduce(local_max, p, dist.ReduceOp.MAX)
        shifted = logits - local_max.unsqueeze(-1)
        vocab_local = logits.shape[-1]
        in_range = (target >= vocab_start) & (target < vocab_start + vocab_local)
        local_target = (target - vocab_start).clamp(0, vocab_local - 1)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * in_range
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if p is not None:
            both = tp_all_reduce(torch.stack([predicted, sum_exp]), p)
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
    return _VocabParallelCrossEntropy.apply(logits, target, start, p if p.tp > 1 else None)
