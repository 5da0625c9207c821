"""Megatron-engine checkpoints: the files in `scratch/checkpoints/iter_0000025/` (the directory,
its tracker and pruning are training.py's, shared with the reference engine).

`model/`: the weights as torch_dist (dist_checkpointing, which can reshard); per (tp, pp) rank
`optim_tpXX_ppYYY.safetensors` with `optim_tpXX_ppYYY.json`, the optimizer's state as tensors
and a JSON skeleton (no pickle); `rng_rankXXXXX.safetensors` (torch's CPU and CUDA states and
Megatron's CUDA RNG tracker); `meta.json` (iteration, consumed samples, seed, tp, pp, dp,
engine "megatron").
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from .. import training as T
from ..errors import CheckpointError


def _encode(obj, path, tensors):
    """Optimizer state -> JSON skeleton plus named tensors (safetensors), so no pickle is involved."""
    if isinstance(obj, torch.Tensor):
        key = "/".join(path)
        tensors[key] = obj.detach().cpu().contiguous()
        return {"t": key}
    if isinstance(obj, dict):
        return {"d": [[k, _encode(v, [*path, str(k)], tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"l": [_encode(v, [*path, str(i)], tensors) for i, v in enumerate(obj)], "tuple": isinstance(obj, tuple)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"v": obj}
    raise CheckpointError(
        f"optimizer state at {'/'.join(path)} holds a {type(obj).__name__}",
        "only tensors and plain values can be checkpointed",
    )


def _decode(node, tensors, device):
    if "t" in node:
        t = tensors[node["t"]]
        return t if t.ndim == 0 and t.device.type == "cpu" and t.dtype == torch.float32 else t.to(device)
    if "d" in node:
        return {k: _decode(v, tensors, device) for k, v in node["d"]}
    if "l" in node:
        items = [_decode(v, tensors, device) for v in node["l"]]
        return tuple(items) if node["tuple"] else items
    return node["v"]


def save_optimizer(opt, directory: str, tp_rank: int, pp_rank: int) -> None:
    from safetensors.torch import save_file

    tensors = {}
    skeleton = _encode(opt.state_dict(), [], tensors)
    stem = os.path.join(directory, f"optim_tp{tp_rank:02}_pp{pp_rank:03}")
    save_file(tensors, stem + ".safetensors")
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(skeleton, f)


def load_optimizer(opt, directory: str, tp_rank: int, pp_rank: int) -> None:
    from safetensors.torch import load_file

    stem = os.path.join(directory, f"optim_tp{tp_rank:02}_pp{pp_rank:03}")
    tensors = load_file(stem + ".safetensors")
    with open(stem + ".json", encoding="utf-8") as f:
        skeleton = json.load(f)
    opt.load_state_dict(_decode(skeleton, tensors, torch.device("cuda", torch.cuda.current_device())))


def save(root: str, iteration: int, model, opt, meta: dict) -> None:
    from megatron.core import dist_checkpointing, parallel_state as ps
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from safetensors.torch import save_file

    rank = dist.get_rank()
    tmp = T.begin_checkpoint(root, iteration, rank == 0, subdirs=("model",))
    dist.barrier()
    # Model weights as torch_dist (resharding-capable); the optimizer per (tp, pp) rank as safetensors.
    # The unwrapped GPTModel: Megatron's DDP would prefix every key with "module.".
    dist_checkpointing.save(getattr(model, "module", model).sharded_state_dict(prefix=""), os.path.join(tmp, "model"))
    if ps.get_data_parallel_rank() == 0:
        save_optimizer(opt, tmp, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state()}
    rng.update({f"tracker/{k}": v for k, v in get_cuda_rng_tracker().get_states().items()})
    save_file(rng, os.path.join(tmp, f"rng_rank{rank:05}.safetensors"))
    dist.barrier()
    if rank == 0:
        T.publish_checkpoint(root, iteration, {**meta, "iteration": iteration, "engine": "megatron"})
    dist.barrier()


def load(root: str, iteration: int, model, opt, tp: int, pp: int) -> dict:
    from megatron.core import dist_checkpointing, parallel_state as ps
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from safetensors import safe_open

    d = T.iter_dir(root, iteration)
    meta = T.read_meta(root, iteration)
    if meta.get("engine") != "megatron":
        raise CheckpointError(
            f"{d}: written by the {meta.get('engine', 'reference')} engine",
            "resume with the same engine, or clear the scratch directory",
        )
    inner = getattr(model, "module", model)
    state = dist_checkpointing.load(inner.sharded_state_dict(prefix=""), os.path.join(d, "model"))
    result = inner.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise CheckpointError(
            f"{d}: checkpoint lacks {', '.join(missing[:5])}", "clear the scratch directory to start over"
        )
    if meta.get("tp") != tp or meta.get("pp") != pp:
        raise CheckpointError(
            f"{d}: saved with tp={meta.get('tp')} pp={meta.get('pp')}, this run has tp={tp} pp={pp}",
            "resume with the same layout, or clear the scratch directory",
        )
    load_optimizer(opt, d, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    rng_path = os.path.join(d, f"rng_rank{dist.get_rank():05}.safetensors")
    if os.path.exists(rng_path):
        with safe_open(rng_path, framework="pt") as f:
            torch.set_rng_state(f.get_tensor("cpu"))
            torch.cuda.set_rng_state(f.get_tensor("cuda"))
            get_cuda_rng_tracker().set_states(
                {k[len("tracker/") :]: f.get_tensor(k) for k in f.keys() if k.startswith("tracker/")}
            )
    return meta
