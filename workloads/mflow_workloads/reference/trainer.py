"""Training loop of the reference engine: TP x PP x DP over torch.distributed, AdamW in fp32.

Data parallelism: every global batch of `global_batch_size` consecutive samples is cut into dp
contiguous slices, rank d taking samples [d * gbs/dp, (d+1) * gbs/dp) in micro-batches (the
megatron engine cuts its batches the same way); gradients are averaged over the dp group.
Pipeline parallelism: see pipeline.py for the schedule; after backward, the two copies of a tied
embedding have their gradients summed over the embedding group, so they stay equal.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time

import torch
import torch.distributed as dist

from .. import data as D
from .. import shards as S
from ..config import TrainConfig
from ..errors import ConfigError, DatasetError
from ..events import Metrics, Progress, Status
from ..flops import flops_per_batch
from ..schedule import lr_at
from . import checkpoint as C
from . import pipeline as PL
from .model import GPT, build
from .optim import AdamW
from .parallel import Parallel, setup, tp_all_reduce


class _Terminate:
    """Remembers SIGTERM so the loop can checkpoint at the next iteration boundary."""

    def __init__(self):
        self.flag = False
        signal.signal(signal.SIGTERM, self._on)

    def _on(self, *_):
        self.flag = True


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
        g.copy_(flat[off: off + g.numel()].view_as(g))
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


def evaluate_loss(model: GPT, src: D.SampleSource, cfg_iters: int, gbs: int, mbs: int, p: Parallel,
                  autocast_dtype, device) -> float:
    """Mean loss over the first `cfg_iters * gbs` windows of a split (a fixed set every time)."""
    model.eval()
    per_dp = gbs // p.dp
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    shape = (mbs, src.seq, model.spec.hidden_size)
    for it in range(cfg_iters):
        losses = PL.forward_only(model, batch_fn(src, it, gbs, mbs, p, device), per_dp // mbs, p, shape, device,
                                 autocast_dtype)
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


def check_layout(cfg: TrainConfig, manifest: dict) -> None:
    """The shards must be converted for the training tp and pp (layers are not moved between
    stages here: the converter's layers_per_stage decides what each stage holds)."""
    if manifest["tp"] != cfg.tp or manifest["pp"] != cfg.pp:
        raise ConfigError(f"shards {cfg.shards} have tp={manifest['tp']} pp={manifest['pp']} but the train config "
                          f"asks tp={cfg.tp} pp={cfg.pp}",
                          "convert (or reshard) the checkpoint for the training tp and pp")


def run(cfg: TrainConfig, device: torch.device) -> dict:
    p = setup(cfg.tp, cfg.dp, cfg.pp)
    is_main = p.rank == 0
    status, metrics = Status(is_main), Metrics(is_main)
    progress = Progress("train", cfg.iterations, "it", is_main)
    manifest = S.read_manifest(cfg.shards)
    spec = S.spec_of(manifest)
    check_layout(cfg, manifest)
    meta = D.read_dataset_json(cfg.data)
    if meta["vocab_size"] > spec.vocab_size:
        raise DatasetError(f"{cfg.data}/dataset.json: vocab_size {meta['vocab_size']} exceeds the model's {spec.vocab_size}",
                           "tokenize the dataset with the model's tokenizer")
    train_src = D.SampleSource(os.path.join(cfg.data, "train"), cfg.seq_length, cfg.seed, True, spec.vocab_size)
    valid_src = D.SampleSource(os.path.join(cfg.data, "valid"), cfg.seq_length, cfg.seed, False, spec.vocab_size)

    torch.manual_seed(cfg.seed + p.rank)
    model = build(spec, p, S.load_rank(cfg.shards, manifest, p.tp_rank, p.pp_rank), attention=cfg.attention,
                  device=device, layers=len(S.stage_layers(manifest, p.pp_rank)) if p.pp > 1 else None)
    sync_tied_embedding(model, p)
    model.train()
    opt = make_optimizer(model, cfg)
    autocast_dtype = torch.bfloat16 if cfg.precision == "bf16" else None

    ckroot = os.path.join(cfg.scratch, "checkpoints")
    if is_main and os.path.isdir(ckroot):
        C.prune(ckroot)
    dist.barrier()
    start = C.latest(ckroot)
    resumed_from = None
    if start is not None:
        C.load(ckroot, start, model, opt, p)
        resumed_from = start
        print(f"[mflow] resumed from checkpoint at iteration {start}", flush=True) if is_main else None
    start = start or 0
    status.update(checkpoint_iteration=resumed_from, resumed_from=resumed_from)

    term = _Terminate()
    num_mb = cfg.num_microbatches
    act_shape = (cfg.micro_batch_size, cfg.seq_length, spec.hidden_size)
    flops = flops_per_batch(spec, cfg.global_batch_size, cfg.seq_length, spec.padded_vocab_for(cfg.tp))
    first_val = last_val = None
    loss_value = float("nan")
    t_start = time.perf_counter()
    tokens_done = 0
    for it in range(start, cfg.iterations):
        t0 = time.perf_counter()
        lr = lr_at(it, cfg.lr, cfg.min_lr, cfg.warmup_iterations, cfg.iterations, cfg.lr_decay)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        batch = batch_fn(train_src, it, cfg.global_batch_size, cfg.micro_batch_size, p, device)
        loss_sum = PL.forward_backward(model, batch, num_mb, p, act_shape, device, autocast_dtype)
        # Megatron's order (finalize_model_grads): data-parallel average, then the embedding group.
        sync_data_parallel_grads(model, p)
        all_reduce_tied_embedding_grads(model, p)
        grad_norm = clip_grad_norm(model, cfg.clip_grad, p)
        opt.step()
        if p.pp > 1:  # the loss is known on the last stage only
            dist.all_reduce(loss_sum, group=p.pp_group)
        loss_value = float(_all_reduce_mean(loss_sum, p.dp_group, p.dp))
        dt = time.perf_counter() - t0
        tokens_done += cfg.global_batch_size * cfg.seq_length
        done = it + 1
        if is_main and (done % cfg.log_interval == 0 or done == cfg.iterations):
            metrics.write(iteration=done, loss=loss_value, lr=lr, grad_norm=grad_norm,
                          tokens_per_s=cfg.global_batch_size * cfg.seq_length / dt,
                          tflops_per_gpu=flops / (dt * 1e12 * p.world), mem_gib=_mem_gib(device), time_s=dt)
        progress.update(done, f"loss {loss_value:.4f} lr {lr:.3g}", force=done == cfg.iterations)
        if done % cfg.eval_interval == 0 or done == cfg.iterations:
            val = evaluate_loss(model, valid_src, cfg.eval_iters, cfg.global_batch_size, cfg.micro_batch_size, p,
                                autocast_dtype, device)
            first_val = val if first_val is None else first_val
            last_val = val
            if is_main:
                metrics.write(iteration=done, val_loss=val, val_ppl=math.exp(min(val, 700)))
        stop = torch.tensor([1.0 if term.flag else 0.0])
        if p.world == p.tp:  # every rank is in the tp group
            stop = tp_all_reduce(stop, p)
        else:
            dist.all_reduce(stop)
        if done % cfg.save_interval == 0 or done == cfg.iterations or stop.item() > 0:
            C.save(ckroot, done, model, opt, p, {"consumed_samples": done * cfg.global_batch_size,
                                                 "seed": cfg.seed, "lr_step": done})
            status.update(checkpoint_iteration=done)
        if stop.item() > 0:
            raise InterruptedError(f"terminated by SIGTERM; checkpoint saved at iteration {done}")

    if p.dp_rank == 0:
        S.write_rank_file(cfg.output, p.tp_rank, p.pp_rank, model.state_dict(), S.DTYPES[manifest["dtype"]])
    dist.barrier()
    summary = {"engine": "reference", "iterations": cfg.iterations, "final_loss": loss_value,
               "first_val_loss": first_val, "last_val_loss": last_val,
               "tokens": cfg.iterations * cfg.global_batch_size * cfg.seq_length,
               "tokens_this_attempt": tokens_done, "time_s": time.perf_counter() - t_start,
               "resumed_from": resumed_from, "tp": cfg.tp, "pp": cfg.pp, "dp": cfg.dp}
    if is_main:
        S.finalize_shards(cfg.output, cfg.shards, manifest)
        S.write_train_summary(cfg.output, summary, metrics)
    dist.barrier()
    return summary


def _mem_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    except Exception:  # noqa: BLE001
        return 0.0
