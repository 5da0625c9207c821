"""Runs the reference trainer on each train config given, in one torchrun launch (gloo), and
records which training samples every rank read.

    torchrun ... pp_worker.py CONFIG.json [CONFIG.json ...]

Writes `metrics.jsonl` (rank 0), `samples_rank{R:02}.json` (the rank's (tp, pp, dp)
coordinates and, per training micro-batch it read, its first sample position, windows and
tokens) and `grads_rank{R:02}.safetensors` (the gradients of the last step, as the optimizer
got them: after the dp and embedding-group reductions and clipping) beside each config.
One launch for several configs saves the start-up of torch in every process.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from safetensors.torch import save_file

from mflow_workloads import data as D
from mflow_workloads.config import load_train
from mflow_workloads.reference import parallel as RP, trainer

_reads: list = []
_grads: dict = {}
_batch = D.SampleSource.batch
_clip = trainer.clip_grad_norm


def _recording_clip(model, max_norm, p):
    norm = _clip(model, max_norm, p)
    _grads.clear()
    _grads.update({n: prm.grad.detach().clone() for n, prm in model.named_parameters() if prm.grad is not None})
    return norm


def _recording_batch(self, first, count):
    tokens, labels = _batch(self, first, count)
    if self.shuffle:  # the training split (validation windows are read unshuffled)
        _reads.append(
            {
                "first": first,
                "count": count,
                "windows": [self._window(first + i) for i in range(count)],
                "tokens": torch.cat([tokens, labels[:, -1:]], dim=1).tolist(),
            }
        )
    return tokens, labels


def main():
    D.SampleSource.batch = _recording_batch
    trainer.clip_grad_norm = _recording_clip
    dist.init_process_group("gloo")
    for path in sys.argv[1:]:
        cfg = load_train(path)
        os.environ["MFLOW_METRICS"] = os.path.join(os.path.dirname(path), "metrics.jsonl")
        _reads.clear()
        trainer.run(cfg, torch.device("cpu"))
        t, d, s = RP.coordinates(dist.get_rank(), cfg.tp, cfg.dp, cfg.pp)
        out = os.path.join(os.path.dirname(path), f"samples_rank{dist.get_rank():02}.json")
        with open(out, "w") as f:
            json.dump({"tp_rank": t, "dp_rank": d, "pp_rank": s, "reads": _reads}, f)
        save_file(_grads, os.path.join(os.path.dirname(path), f"grads_rank{dist.get_rank():02}.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
