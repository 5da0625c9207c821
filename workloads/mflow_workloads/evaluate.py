"""Entry point: `python -m torch.distributed.run ... -m mflow_workloads.evaluate CONFIG.json`.

Loss and perplexity per split with the tensor-parallel reference model (on CUDA when visible;
its logits match Megatron-Core's, see docs/validation.md), an optional HF baseline evaluated on
the same windows with transformers, and greedy samples decoded with the shards' tokenizer.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
import torch.distributed as dist

from . import data as D, runtime, shards as S
from .config import load_evaluate
from .errors import ConfigError, ShardsError
from .events import Metrics, Progress
from .reference.model import build, greedy_generate
from .reference.parallel import setup
from .reference.trainer import evaluate_loss

SPLIT_KEY = {"valid": "val", "test": "test", "train": "train"}


def load_tokenizer(shards_dir: str):
    from tokenizers import Tokenizer

    path = os.path.join(shards_dir, "tokenizer", "tokenizer.json")
    if not os.path.isfile(path):
        raise ShardsError(
            f"{path}: missing", "the shards must carry tokenizer/tokenizer.json (mflow convert copies it)"
        )
    return Tokenizer.from_file(path)


@torch.no_grad()
def baseline_loss(hf_dir: str, src: D.SampleSource, count: int, mbs: int, device) -> float:
    """Mean loss of an HF model over windows 0..count-1, as the reference evaluation averages them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    losses = []
    for first in range(0, count, mbs):
        tokens, labels = src.batch(first, min(mbs, count - first))
        logits = model(tokens.to(device)).logits.float()
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.to(device).flatten()).item())
    return sum(losses) / len(losses)


def main(path: str) -> None:
    cfg = load_evaluate(path)
    cuda = runtime.use_cuda("auto" if cfg.engine != "reference" else "reference")
    device = runtime.init_distributed(cuda)
    world = dist.get_world_size()
    if cfg.pp != 1:
        raise ConfigError(f"evaluate config asks pp={cfg.pp}", "evaluation runs with pp = 1; reshard to pp = 1 first")
    if world % cfg.tp:
        raise ConfigError(f"launched {world} processes, not a multiple of tp={cfg.tp}", "launch tp * k processes")
    manifest = S.read_manifest(cfg.shards)
    if manifest["tp"] != cfg.tp:
        raise ConfigError(
            f"shards {cfg.shards} have tp={manifest['tp']} but evaluate was launched with tp={cfg.tp}",
            "mflow inserts a reshard step; re-run with shards converted for this tp",
        )
    p = setup(cfg.tp, world // cfg.tp)
    spec = S.spec_of(manifest)
    # Every id of every split evaluated, before the model is loaded (SampleSource then skips it).
    D.check_splits(cfg.data, cfg.splits, spec.vocab_size)
    model = build(spec, p, S.load_rank(cfg.shards, manifest, p.tp_rank), device=device).eval()
    autocast_dtype = torch.bfloat16 if cfg.precision == "bf16" else None
    progress = Progress("evaluate", len(cfg.splits) + len(cfg.prompts), "it", p.rank == 0)
    out: dict = {}
    gbs = cfg.micro_batch_size * p.dp
    done = 0
    for split in cfg.splits:
        src = D.SampleSource(os.path.join(cfg.data, split), cfg.seq_length, 0, False, spec.vocab_size)
        loss = evaluate_loss(model, src, cfg.eval_iters, gbs, cfg.micro_batch_size, p, autocast_dtype, device)
        key = SPLIT_KEY[split]
        out[f"{key}_loss"], out[f"{key}_ppl"] = loss, math.exp(min(loss, 700))
        if cfg.baseline and split == "valid" and p.rank == 0:
            b = baseline_loss(cfg.baseline, src, cfg.eval_iters * gbs, cfg.micro_batch_size, device)
            out.update(baseline_val_loss=b, baseline_val_ppl=math.exp(min(b, 700)), val_loss_delta_vs_baseline=loss - b)
        done += 1
        progress.update(done, f"{split} loss {loss:.4f}")
    dist.barrier()
    tok = load_tokenizer(cfg.shards)
    samples = []
    for prompt in cfg.prompts:
        ids = tok.encode(prompt).ids or [0]
        new = greedy_generate(model, ids, cfg.max_new_tokens, device, autocast_dtype)
        samples.append({"prompt": prompt, "completion": tok.decode(new)})
        done += 1
        progress.update(done, "generating")
    out["samples"] = samples
    if p.rank == 0:
        os.makedirs(cfg.output, exist_ok=True)
        tmp = os.path.join(cfg.output, ".metrics.json.partial")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
        os.replace(tmp, os.path.join(cfg.output, "metrics.json"))
        Metrics().write(**{k: v for k, v in out.items() if k != "samples"})
    dist.barrier()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m mflow_workloads.evaluate CONFIG.json", file=sys.stderr)
        sys.exit(2)
    sys.exit(runtime.run_main(main, sys.argv[1]))
