"""Training loop of the reference engine: TP x DP over torch.distributed, AdamW in fp32."""

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
from .model import GPT, build
from .parallel import Parallel, setup


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


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    # As Megatron: no weight decay on biases and norm weights (1-D tensors).
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=1e-8)


def clip_grad_norm(model: torch.nn.Module, max_norm: float, p: Parallel) -> float:
    """Global L2 norm over the whole model; replicated tensors count once (tp rank 0)."""
    sq = torch.zeros((), dtype=torch.float64)
    grads = []
    for prm in model.parameters():
        if prm.grad is None:
            continue
        grads.append(prm.grad)
        if getattr(prm, "tensor_model_parallel", False) or p.tp_rank == 0:
            sq += prm.grad.detach().double().pow(2).sum().cpu()
    if p.tp > 1:
        dist.all_reduce(sq, group=p.tp_group)
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


def evaluate_loss(model: GPT, src: D.SampleSource, cfg_iters: int, gbs: int, mbs: int, p: Parallel,
                  autocast_dtype, device) -> float:
    """Mean loss over the first `cfg_iters * gbs` windows of a split (a fixed set every time)."""
    model.eval()
    per_dp = gbs // p.dp
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    with torch.no_grad():
        for it in range(cfg_iters):
            for mb in range(per_dp // mbs):
                first = it * gbs + p.dp_rank * per_dp + mb * mbs
                tokens, labels = src.batch(first, mbs)
                with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
                    loss = model.loss(tokens.to(device), labels.to(device)).float().mean()
                total += loss.double().cpu()
                count += 1
    t = torch.tensor([total.item(), float(count)], dtype=torch.float64)
    if p.dp > 1:
        dist.all_reduce(t, group=p.dp_group)
    model.train()
    return float(t[0] / t[1])


def run(cfg: TrainConfig, device: torch.device) -> dict:
    p = setup(cfg.tp, cfg.dp, cfg.pp)
    is_main = p.rank == 0
    status, metrics = Status(is_main), Metrics(is_main)
    progress = Progress("train", cfg.iterations, "it", is_main)
    manifest = S.read_manifest(cfg.shards)
    spec = S.spec_of(manifest)
    if manifest["tp"] != cfg.tp:
        raise ConfigError(f"shards {cfg.shards} have tp={manifest['tp']} but the train config asks tp={cfg.tp}",
                          "convert (or reshard) the checkpoint for the training tp")
    meta = D.read_dataset_json(cfg.data)
    if meta["vocab_size"] > spec.vocab_size:
        raise DatasetError(f"{cfg.data}/dataset.json: vocab_size {meta['vocab_size']} exceeds the model's {spec.vocab_size}",
                           "tokenize the dataset with the model's tokenizer")
    train_src = D.SampleSource(os.path.join(cfg.data, "train"), cfg.seq_length, cfg.seed, True, spec.vocab_size)
    valid_src = D.SampleSource(os.path.join(cfg.data, "valid"), cfg.seq_length, cfg.seed, False, spec.vocab_size)

    torch.manual_seed(cfg.seed + p.rank)
    model = build(spec, p, S.load_rank(cfg.shards, manifest, p.tp_rank), attention=cfg.attention, device=device)
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
    per_dp = cfg.global_batch_size // cfg.dp
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
        loss_sum = torch.zeros((), dtype=torch.float64)
        for mb in range(num_mb):
            first = it * cfg.global_batch_size + p.dp_rank * per_dp + mb * cfg.micro_batch_size
            tokens, labels = train_src.batch(first, cfg.micro_batch_size)
            with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
                loss = model.loss(tokens.to(device), labels.to(device)).float().mean() / num_mb
            loss.backward()
            loss_sum += loss.detach().double().cpu()
        sync_data_parallel_grads(model, p)
        grad_norm = clip_grad_norm(model, cfg.clip_grad, p)
        opt.step()
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
        dist.all_reduce(stop)
        if done % cfg.save_interval == 0 or done == cfg.iterations or stop.item() > 0:
            C.save(ckroot, done, model, opt, p, {"consumed_samples": done * cfg.global_batch_size,
                                                 "seed": cfg.seed, "lr_step": done})
            status.update(checkpoint_iteration=done)
        if stop.item() > 0:
            raise InterruptedError(f"terminated by SIGTERM; checkpoint saved at iteration {done}")

    if p.dp_rank == 0:
        S.write_rank_file(cfg.output, p.tp_rank, 0, model.state_dict(), S.DTYPES[manifest["dtype"]])
    dist.barrier()
    summary = {"engine": "reference", "iterations": cfg.iterations, "final_loss": loss_value,
               "first_val_loss": first_val, "last_val_loss": last_val,
               "tokens": cfg.iterations * cfg.global_batch_size * cfg.seq_length,
               "tokens_this_attempt": tokens_done, "time_s": time.perf_counter() - t_start,
               "resumed_from": resumed_from, "tp": cfg.tp, "dp": cfg.dp}
    if is_main:
        S.finalize_shards(cfg.output, cfg.shards, manifest)
        with open(os.path.join(cfg.output, "train_summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
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
