"""Training loop of the reference engine: TP x PP x DP over torch.distributed, AdamW in fp32.

Data parallelism: every global batch of `global_batch_size` consecutive samples is cut into dp
contiguous slices, rank d taking samples [d * gbs/dp, (d+1) * gbs/dp) in micro-batches (the
megatron engine cuts its batches the same way); gradients are averaged over the dp group.
Pipeline parallelism: see pipeline.py for the schedule; after backward, the two copies of a tied
embedding have their gradients summed over the embedding group, so they stay equal.
"""

from __future__ import annotations

import math
import os
import resource

import torch
import torch.distributed as dist

from .. import data as D, shards as S, training as T
from ..config import TrainConfig
from . import checkpoint as C, pipeline as PL
from .model import GPT, build
from .optim import AdamW
from .parallel import Parallel, setup, tp_all_reduce


def _all_reduce_mean(t: torch.Tensor, group, size: int) -> torch.Tensor:
    if size > 1:
        dist.all_reduce(t, group=group)
        t /= size
    return t


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    # As Megatron: no weight decay on biases and norm weights (1-D tensors).
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # On CUDA torch takes its multi-tensor path, which only torch's class runs.
    cls = AdamW if all(p.device.type == "cpu" for p in decay + no_decay) else torch.optim.AdamW
    return cls(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=1e-8)


def clip_grad_norm(model: torch.nn.Module, max_norm: float, p: Parallel) -> float:
    """Global L2 norm over the whole model (all tp ranks and stages); replicated tensors count once
    (tp rank 0), and so does a tied embedding held by two stages (the first stage's copy)."""
    sq = torch.zeros((), dtype=torch.float64)
    grads = []
    for prm in model.parameters():
        if prm.grad is None:
            continue
        grads.append(prm.grad)
        if getattr(prm, "shared_copy", False):
            continue
        if getattr(prm, "tensor_model_parallel", False) or p.tp_rank == 0:
            sq += prm.grad.detach().double().pow(2).sum().cpu()
    if p.pp == 1 and p.tp > 1:
        sq = tp_all_reduce(sq, p)  # the model-parallel group is the tp group
    elif p.tp * p.pp > 1:
        dist.all_reduce(sq, group=p.mp_group)
    norm = math.sqrt(sq.item())
    if max_norm > 0 and norm > max_norm:
        coeff = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(coeff)
    return norm


def sync_data_parallel_grads(model: torch.nn.Module, p: Parallel) -> None:
    if p.dp == 1:
        return
    grads = [prm.grad for prm in model.parameters() if prm.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=p.dp_group)
    flat /= p.dp
    off = 0
    for g in grads:
        g.copy_(flat[off : off + g.numel()].view_as(g))
        off += g.numel()


def sync_tied_embedding(model: GPT, p: Parallel) -> None:
    """Makes the last stage's copy of a tied embedding equal to the first stage's, as Megatron
    does when it builds the model (the shards already hold equal copies; this makes it certain)."""
    w = model.shared_embedding()
    if w is not None:
        with torch.no_grad():
            dist.broadcast(w.data, src=p.embedding_ranks[0], group=p.embedding_group)


def all_reduce_tied_embedding_grads(model: GPT, p: Parallel) -> None:
    """Sums the gradients of the two copies of a tied embedding (first and last stage), so both
    take the same optimizer step: the gradient the single tensor would get at pp = 1."""
    w = model.shared_embedding()
    if w is not None and w.grad is not None:
        dist.all_reduce(w.grad, group=p.embedding_group)


def batch_fn(src: D.SampleSource, it: int, gbs: int, mbs: int, p: Parallel, device):
    """Micro-batch `mb` of this dp rank at iteration `it`: tokens where the first stage needs them,
    labels where the last stage does (a middle stage reads nothing)."""

    def batch(mb: int):
        if not (p.is_first_stage or p.is_last_stage):
            return None, None
        tokens, labels = src.batch(D.first_sample(it, mb, gbs, mbs, p.dp, p.dp_rank), mbs)
        return (tokens.to(device) if p.is_first_stage else None), (labels.to(device) if p.is_last_stage else None)

    return batch


def evaluate_loss(
    model: GPT, src: D.SampleSource, cfg_iters: int, gbs: int, mbs: int, p: Parallel, autocast_dtype, device
) -> float:
    """Mean loss over the first `cfg_iters * gbs` windows of a split (a fixed set every time)."""
    model.eval()
    per_dp = gbs // p.dp
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    shape = (mbs, src.seq, model.spec.hidden_size)
    for it in range(cfg_iters):
        losses = PL.forward_only(
            model, batch_fn(src, it, gbs, mbs, p, device), per_dp // mbs, p, shape, device, autocast_dtype
        )
        for loss in losses:
            total += loss.double().cpu()
            count += 1
    t = torch.tensor([total.item(), float(count)], dtype=torch.float64)
    if p.pp > 1:  # only the last stage has losses
        dist.all_reduce(t, group=p.pp_group)
    if p.dp > 1:
        dist.all_reduce(t, group=p.dp_group)
    model.train()
    return float(t[0] / t[1])


class ReferenceEngine:
    """One rank of the reference engine, for training.train."""

    name = "reference"

    def __init__(self, cfg: TrainConfig, p: Parallel, manifest: dict, spec: S.ModelSpec, device: torch.device):
        self.cfg, self.p, self.manifest, self.device = cfg, p, manifest, device
        self.train_src = D.SampleSource(
            os.path.join(cfg.data, "train"), cfg.seq_length, cfg.seed, True, spec.vocab_size
        )
        self.valid_src = D.SampleSource(
            os.path.join(cfg.data, "valid"), cfg.seq_length, cfg.seed, False, spec.vocab_size
        )
        torch.manual_seed(cfg.seed + p.rank)
        self.model = build(
            spec,
            p,
            S.load_rank(cfg.shards, manifest, p.tp_rank, p.pp_rank),
            attention=cfg.attention,
            device=device,
            layers=len(S.stage_layers(manifest, p.pp_rank)) if p.pp > 1 else None,
        )
        sync_tied_embedding(self.model, p)
        self.model.train()
        self.opt = make_optimizer(self.model, cfg)
        self.autocast_dtype = torch.bfloat16 if cfg.precision == "bf16" else None
        self.act_shape = (cfg.micro_batch_size, cfg.seq_length, spec.hidden_size)

    def load(self, root: str, iteration: int) -> None:
        C.load(root, iteration, self.model, self.opt, self.p)

    def start(self) -> None:
        pass

    def step(self, iteration: int, lr: float) -> tuple[float, float]:
        cfg, p, model = self.cfg, self.p, self.model
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        batch = batch_fn(self.train_src, iteration, cfg.global_batch_size, cfg.micro_batch_size, p, self.device)
        loss_sum = PL.forward_backward(
            model, batch, cfg.num_microbatches, p, self.act_shape, self.device, self.autocast_dtype
        )
        # Megatron's order (finalize_model_grads): data-parallel average, then the embedding group.
        sync_data_parallel_grads(model, p)
        all_reduce_tied_embedding_grads(model, p)
        grad_norm = clip_grad_norm(model, cfg.clip_grad, p)
        self.opt.step()
        if p.pp > 1:  # the loss is known on the last stage only
            dist.all_reduce(loss_sum, group=p.pp_group)
        return float(_all_reduce_mean(loss_sum, p.dp_group, p.dp)), grad_norm

    def validation_loss(self) -> float:
        cfg = self.cfg
        return evaluate_loss(
            self.model,
            self.valid_src,
            cfg.eval_iters,
            cfg.global_batch_size,
            cfg.micro_batch_size,
            self.p,
            self.autocast_dtype,
            self.device,
        )

    def any_rank_stops(self, requested: bool) -> bool:
        stop = torch.tensor([1.0 if requested else 0.0])
        if self.p.world == self.p.tp:  # every rank is in the tp group
            stop = tp_all_reduce(stop, self.p)
        else:
            dist.all_reduce(stop)
        return stop.item() > 0

    def save(self, root: str, iteration: int) -> None:
        meta = {"consumed_samples": iteration * self.cfg.global_batch_size, "seed": self.cfg.seed, "lr_step": iteration}
        C.save(root, iteration, self.model, self.opt, self.p, meta)

    def peak_mem_gib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB

    def write_output(self) -> None:
        p = self.p
        if p.dp_rank == 0:
            S.write_rank_file(
                self.cfg.output, p.tp_rank, p.pp_rank, self.model.state_dict(), S.DTYPES[self.manifest["dtype"]]
            )
        dist.barrier()


def run(cfg: TrainConfig, device: torch.device) -> dict:
    p = setup(cfg.tp, cfg.dp, cfg.pp)
    manifest, spec, _ = T.read_inputs(cfg)
    return T.train(cfg, ReferenceEngine(cfg, p, manifest, spec, device), manifest, p.rank == 0)
