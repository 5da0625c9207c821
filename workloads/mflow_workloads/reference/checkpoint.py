"""Reference-engine checkpoints: the files in `scratch/checkpoints/iter_0000025/` (the directory,
its tracker and pruning are training.py's, shared with the Megatron engine).

`model_tpXX.safetensors`, `optim_tpXX.safetensors` (AdamW moments and step per parameter name),
`rng_rankXXXXX.safetensors` (torch RNG states) and `meta.json` (iteration, consumed samples,
LR-schedule position, seed). With pp > 1 the model and optimizer files are per stage,
`model_tpXX_ppYYY.safetensors` and `optim_tpXX_ppYYY.safetensors` (stage-local layer names, as in
the shards), and meta.json also records `pp`; at pp = 1 names and bytes are those of the
tensor-parallel-only format, so its checkpoints resume unchanged.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from .. import training as T
from ..errors import CheckpointError
from .parallel import Parallel


def rank_suffix(p: Parallel) -> str:
    return f"tp{p.tp_rank:02}" if p.pp == 1 else f"tp{p.tp_rank:02}_pp{p.pp_rank:03}"


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def save(
    root: str, iteration: int, model: torch.nn.Module, opt: torch.optim.Optimizer, p: Parallel, meta: dict
) -> None:
    tmp = T.begin_checkpoint(root, iteration, p.rank == 0)
    _barrier()
    if p.dp_rank == 0:  # model and optimizer are replicated across data-parallel ranks
        names = {id(prm): n for n, prm in model.named_parameters()}
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
            os.path.join(tmp, f"model_{rank_suffix(p)}.safetensors"),
        )
        moments = {}
        for prm, st in opt.state.items():
            n = names[id(prm)]
            for key in ("exp_avg", "exp_avg_sq"):
                moments[f"{key}/{n}"] = st[key].detach().cpu().contiguous()
            moments[f"step/{n}"] = torch.as_tensor(st["step"], dtype=torch.float64).reshape(1).cpu()
        save_file(moments, os.path.join(tmp, f"optim_{rank_suffix(p)}.safetensors"))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, os.path.join(tmp, f"rng_rank{p.rank:05}.safetensors"))
    _barrier()
    if p.rank == 0:
        record = {**meta, "iteration": iteration, "tp": p.tp, "dp": p.dp}
        if p.pp > 1:  # absent at pp = 1, where meta.json stays as it was before pipelines
            record["pp"] = p.pp
        T.publish_checkpoint(root, iteration, record)
    _barrier()


def load(root: str, iteration: int, model: torch.nn.Module, opt: torch.optim.Optimizer, p: Parallel) -> dict:
    d = T.iter_dir(root, iteration)
    meta = T.read_meta(root, iteration)
    if meta["tp"] != p.tp or meta.get("pp", 1) != p.pp:
        raise CheckpointError(
            f"{d}: saved with tp={meta['tp']} pp={meta.get('pp', 1)}, this run has tp={p.tp} pp={p.pp}",
            "resume with the same tp and pp, or clear the scratch directory",
        )
    device = next(model.parameters()).device
    with safe_open(os.path.join(d, f"model_{rank_suffix(p)}.safetensors"), framework="pt") as f:
        model.load_state_dict({k: f.get_tensor(k) for k in f.keys()}, strict=True)
    params = dict(model.named_parameters())
    with safe_open(os.path.join(d, f"optim_{rank_suffix(p)}.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        for n, prm in params.items():
            if f"exp_avg/{n}" not in keys:
                continue
            opt.state[prm] = {
                "step": f.get_tensor(f"step/{n}").reshape(()).float(),
                "exp_avg": f.get_tensor(f"exp_avg/{n}").to(device),
                "exp_avg_sq": f.get_tensor(f"exp_avg_sq/{n}").to(device),
            }
    rng_path = os.path.join(d, f"rng_rank{p.rank:05}.safetensors")
    if os.path.exists(rng_path):
        with safe_open(rng_path, framework="pt") as f:
            torch.set_rng_state(f.get_tensor("cpu"))
            if "cuda" in f.keys() and torch.cuda.is_available():
                torch.cuda.set_rng_state(f.get_tensor("cuda"))
    return meta
