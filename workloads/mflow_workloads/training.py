"""What the two training engines (reference/ and megatron/) share.

- Inputs: the shards must be converted for the train config's tp and pp, and the dataset's
  vocabulary must fit the model's: dataset.json's vocab_size, and every token id of the splits
  read (data.check_splits).
- The training loop's outer shape (`train`): resume from the newest checkpoint, then per
  iteration the learning rate (schedule.lr_at), one optimizer step, metrics every log_interval,
  validation every eval_interval, a checkpoint every save_interval, at the end, and at the next
  iteration boundary after SIGTERM (then the attempt fails, to be resumed); then the output
  (shards, train_summary.json) and the attempt's own figures in the metrics.
- Reports to mflow: progress, metrics and status (events.py), written by rank 0.
- Checkpoints under `scratch/checkpoints/`: `iter_0000025/` per checkpoint (what the files in it
  are is the engine's, beside a `meta.json`), written into `.tmp_iter_*`, renamed when complete,
  and only then named by the tracker file `latest_checkpointed_iteration.txt` (replaced
  atomically). The newest two are kept; what a killed attempt left is removed at the next start.

An engine is what differs: an `Engine` does one optimizer step, the validation loss, saving and
loading its checkpoint, its memory figure, and its output shards.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.distributed as dist

from . import data as D, shards as S
from .config import TrainConfig
from .errors import CheckpointError, ConfigError, DatasetError
from .events import Metrics, Progress, Status
from .flops import flops_per_batch
from .schedule import lr_at

TRACKER = "latest_checkpointed_iteration.txt"
KEEP = 2


# -- inputs


def check_shards_layout(manifest: dict, tp: int, pp: int, where: str = "the shards") -> None:
    """The shards must be converted for the training tp and pp (no engine moves layers between
    stages: the converter's layers_per_stage decides what each stage holds)."""
    if manifest["tp"] != tp or manifest["pp"] != pp:
        raise ConfigError(
            f"{where} have tp={manifest['tp']} pp={manifest['pp']} but the train config asks tp={tp} pp={pp}",
            "convert (or reshard) the checkpoint for the training tp and pp",
        )


def check_layout(cfg: TrainConfig, manifest: dict) -> None:
    check_shards_layout(manifest, cfg.tp, cfg.pp, f"shards {cfg.shards}")


def read_inputs(cfg: TrainConfig) -> tuple[dict[str, Any], S.ModelSpec, dict[str, Any]]:
    """The shards' manifest and model, and dataset.json, checked against the config and each other."""
    manifest = S.read_manifest(cfg.shards)
    spec = S.spec_of(manifest)
    check_layout(cfg, manifest)
    meta = D.read_dataset_json(cfg.data)
    if meta["vocab_size"] > spec.vocab_size:
        raise DatasetError(
            f"{cfg.data}/dataset.json: vocab_size {meta['vocab_size']} exceeds the model's {spec.vocab_size}",
            "tokenize the dataset with the model's tokenizer",
        )
    # Every id of every split either engine reads, once, before the model is built.
    D.check_splits(cfg.data, D.TRAINING_SPLITS, spec.vocab_size)
    return manifest, spec, meta


# -- checkpoints


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def tmp_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f".tmp_iter_{iteration:07d}")


def latest(root: str) -> int | None:
    """The iteration named by the tracker, if that checkpoint is complete."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read(64).strip()
    if not re.fullmatch(r"\d{1,12}", text):
        raise CheckpointError(
            f"{path}: tracker holds {text!r}, not an iteration number",
            "delete the scratch directory to start over, or restore the file",
        )
    it = int(text)
    if not os.path.exists(os.path.join(iter_dir(root, it), "meta.json")):
        raise CheckpointError(
            f"{path} names iteration {it} but {iter_dir(root, it)} is incomplete",
            "delete the scratch checkpoints directory to start over",
        )
    return it


def prune(root: str) -> None:
    """Keeps the newest KEEP checkpoints and removes what a killed attempt left half-written."""
    its = sorted(int(m.group(1)) for d in os.listdir(root) if (m := re.fullmatch(r"iter_(\d{7})", d)))
    for it in its[:-KEEP]:
        shutil.rmtree(iter_dir(root, it), ignore_errors=True)
    for d in os.listdir(root):
        if d.startswith(".tmp_iter_"):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def begin_checkpoint(root: str, iteration: int, is_main: bool, subdirs: tuple[str, ...] = ()) -> str:
    """Rank 0 makes the empty `.tmp_iter_*` directory (with `subdirs`) that every rank then
    writes into, after a barrier; returns its path."""
    tmp = tmp_dir(root, iteration)
    if is_main:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for sub in subdirs:
            os.makedirs(os.path.join(tmp, sub))
    return tmp


def publish_checkpoint(root: str, iteration: int, meta: dict[str, Any]) -> None:
    """Rank 0, once every rank has written its files: meta.json, the rename into place, the
    tracker, and pruning."""
    tmp = tmp_dir(root, iteration)
    with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f)
    final = iter_dir(root, iteration)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    tracker_tmp = os.path.join(root, f".{TRACKER}.tmp")
    with open(tracker_tmp, "w", encoding="utf-8") as f:
        f.write(str(iteration))
    os.replace(tracker_tmp, os.path.join(root, TRACKER))
    prune(root)


def read_meta(root: str, iteration: int) -> dict[str, Any]:
    with open(os.path.join(iter_dir(root, iteration), "meta.json"), encoding="utf-8") as f:
        return json.load(f)


def resume_point(root: str, is_main: bool) -> int | None:
    """The iteration to resume from (None: from the start), once rank 0 has pruned."""
    if is_main and os.path.isdir(root):
        prune(root)
    dist.barrier()
    return latest(root)


# -- the loop


class Engine(Protocol):
    """What a training engine does; `train` calls it on every rank."""

    name: str

    def load(self, root: str, iteration: int) -> None:
        """Restores model, optimizer and RNG states from checkpoint `iteration` under `root`."""

    def start(self) -> None:
        """Called once before the first iteration of this attempt (after any resume)."""

    def step(self, iteration: int, lr: float) -> tuple[float, float]:
        """One optimizer step at `lr` on global batch `iteration`: (loss, grad norm), the loss
        averaged over the data-parallel replicas and known on every rank."""

    def validation_loss(self) -> float:
        """The mean loss over the first eval_iters global batches of the validation split."""

    def any_rank_stops(self, requested: bool) -> bool:
        """Whether any rank asked to stop (a collective: every rank calls it)."""

    def save(self, root: str, iteration: int) -> None:
        """Writes checkpoint `iteration` (begin_checkpoint ... publish_checkpoint)."""

    def peak_mem_gib(self) -> float:
        """Peak memory so far, in GiB (every rank calls it: it may be a collective)."""

    def write_output(self) -> None:
        """Writes this rank's part of the trained shards into cfg.output."""


class _Terminate:
    """Remembers SIGTERM so the loop can checkpoint at the next iteration boundary."""

    def __init__(self):
        self.flag = False
        signal.signal(signal.SIGTERM, self._on)

    def _on(self, *_):
        self.flag = True


@dataclass
class _Attempt:
    """What this attempt did: the figures of the summary and of its metrics."""

    resumed_from: int | None = None
    resume_load_s: float | None = None
    final_loss: float = float("nan")
    first_val_loss: float | None = None
    last_val_loss: float | None = None
    tokens: int = 0
    time_s: float = 0.0
    checkpoint_save_s: list[float] = field(default_factory=list)


class _Reports:
    """Progress, metrics and status for mflow, written by rank 0 (one Status: it rewrites its
    whole state each time)."""

    def __init__(self, cfg: TrainConfig, is_main: bool):
        self.is_main = is_main
        self.status, self.metrics = Status(is_main), Metrics(is_main)
        self.progress = Progress("train", cfg.iterations, "it", is_main)

    def say(self, line: str) -> None:
        if self.is_main:
            print(f"[mflow] {line}", flush=True)


def _resume(engine: Engine, root: str, reports: _Reports) -> _Attempt:
    attempt = _Attempt()
    start = resume_point(root, reports.is_main)
    if start is not None:
        t0 = time.perf_counter()
        engine.load(root, start)
        attempt.resumed_from, attempt.resume_load_s = start, time.perf_counter() - t0
        reports.say(f"resumed from checkpoint at iteration {start} in {attempt.resume_load_s:.1f}s")
    reports.status.update(checkpoint_iteration=start, resumed_from=start)
    return attempt


def _loop(cfg: TrainConfig, engine: Engine, spec: S.ModelSpec, attempt: _Attempt, reports: _Reports) -> None:
    root = os.path.join(cfg.scratch, "checkpoints")
    tokens_per_batch = cfg.global_batch_size * cfg.seq_length
    flops = flops_per_batch(spec, cfg.global_batch_size, cfg.seq_length, spec.padded_vocab_for(cfg.tp))
    term = _Terminate()
    engine.start()
    t_start = time.perf_counter()
    for it in range(attempt.resumed_from or 0, cfg.iterations):
        t0 = time.perf_counter()
        lr = lr_at(it, cfg.lr, cfg.min_lr, cfg.warmup_iterations, cfg.iterations, cfg.lr_decay)
        loss, grad_norm = engine.step(it, lr)
        dt = time.perf_counter() - t0
        attempt.final_loss = loss
        attempt.tokens += tokens_per_batch
        done = it + 1
        last = done == cfg.iterations
        if done % cfg.log_interval == 0 or last:
            # The whole job's tokens per second; FLOP/s per GPU over all tp*pp*dp ranks.
            mem = engine.peak_mem_gib()
            reports.metrics.write(
                iteration=done,
                loss=loss,
                lr=lr,
                grad_norm=grad_norm,
                tokens_per_s=tokens_per_batch / dt,
                tflops_per_gpu=flops / (dt * 1e12 * cfg.world_size),
                mem_gib=mem,
                time_s=dt,
            )
        reports.progress.update(done, f"loss {loss:.4f} lr {lr:.3g}", force=last)
        if done % cfg.eval_interval == 0 or last:
            val = engine.validation_loss()
            attempt.first_val_loss = val if attempt.first_val_loss is None else attempt.first_val_loss
            attempt.last_val_loss = val
            reports.metrics.write(iteration=done, val_loss=val, val_ppl=math.exp(min(val, 700)))
        stop = engine.any_rank_stops(term.flag)
        if done % cfg.save_interval == 0 or last or stop:
            t0 = time.perf_counter()
            engine.save(root, done)
            attempt.checkpoint_save_s.append(time.perf_counter() - t0)
            reports.status.update(checkpoint_iteration=done)
            reports.say(f"checkpoint at iteration {done} saved in {attempt.checkpoint_save_s[-1]:.1f}s")
        if stop:
            raise InterruptedError(f"terminated by SIGTERM; checkpoint saved at iteration {done}")
    attempt.time_s = time.perf_counter() - t_start


def train(cfg: TrainConfig, engine: Engine, manifest: dict, is_main: bool, **extra: Any) -> dict:
    """Resumes, trains to cfg.iterations and writes the output; returns the summary, whose
    committed part (train_summary.json) gets `extra` after the common keys."""
    reports = _Reports(cfg, is_main)
    attempt = _resume(engine, os.path.join(cfg.scratch, "checkpoints"), reports)
    _loop(cfg, engine, S.spec_of(manifest), attempt, reports)
    engine.write_output()
    summary = {
        "engine": engine.name,
        "iterations": cfg.iterations,
        "final_loss": attempt.final_loss,
        "first_val_loss": attempt.first_val_loss,
        "last_val_loss": attempt.last_val_loss,
        "tokens": cfg.iterations * cfg.global_batch_size * cfg.seq_length,
        # The attempt's own figures (S.ATTEMPT_FIELDS): they go to its metrics, not the output.
        "tokens_this_attempt": attempt.tokens,
        "time_s": attempt.time_s,
        "resumed_from": attempt.resumed_from,
        "resume_load_s": attempt.resume_load_s,
        "checkpoint_save_s": attempt.checkpoint_save_s,
        "peak_mem_gib": engine.peak_mem_gib(),
        "tp": cfg.tp,
        "pp": cfg.pp,
        "dp": cfg.dp,
        **extra,
    }
    if is_main:
        S.finalize_shards(cfg.output, cfg.shards, manifest)
        S.write_train_summary(cfg.output, summary, reports.metrics)
    dist.barrier()
    return summary
