"""Process setup shared by the workload entry points: distributed init, device, failure reporting."""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist

from .errors import WorkloadError
from .events import Status, classify_exception


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def use_cuda(engine: str) -> bool:
    if engine == "megatron":
        return True
    if engine == "reference":
        return torch.cuda.is_available() and os.environ.get("MFLOW_REFERENCE_DEVICE", "cpu") == "cuda"
    return torch.cuda.is_available()


def init_distributed(cuda: bool, timeout_s: int = 600) -> torch.device:
    """Joins the torchrun group (gloo on CPU, NCCL on CUDA); a single process also works."""
    if cuda:
        torch.cuda.set_device(local_rank())
        device = torch.device("cuda", local_rank())
    else:
        device = torch.device("cpu")
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            **({"device_id": device} if cuda else {}),
        )
    elif not dist.is_initialized():
        # A plain `python -m` run: a group of one, so collectives work the same way.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
        dist.init_process_group(
            "nccl" if cuda else "gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=timeout_s)
        )
    return device


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def run_main(fn, *args) -> int:
    """Runs `fn`, turning failures into a classified MFLOW_STATUS and a clear message."""
    status = Status(enabled=rank() == 0)
    try:
        fn(*args)
        return 0
    except WorkloadError as e:
        if rank() == 0 or e.cls != "user":
            print(e.render(), file=sys.stderr, flush=True)
        status = Status(enabled=True) if rank() == 0 else status
        _merge_status(status, e.cls, str(e))
        return 2 if e.cls == "gate" else 1
    except KeyboardInterrupt:
        _merge_status(status, "infra", "interrupted")
        return 130
    except BaseException as e:  # noqa: BLE001 - every failure must be classified for mflow
        cls = classify_exception(e)
        print(f"error[mflow::workload::{cls}]: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        traceback.print_exc()
        if rank() == 0 or cls == "oom":
            _merge_status(Status(enabled=True), cls, f"{type(e).__name__}: {e}")
        return 1
    finally:
        if dist.is_initialized():
            # A group whose peer is gone fails its shutdown (DistBackendError, a RuntimeError); the
            # outcome is decided already.
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group()


def _merge_status(status: Status, cls: str, message: str) -> None:
    import json

    if status.path and os.path.exists(status.path):
        try:
            with open(status.path, encoding="utf-8") as f:
                status.state.update(json.load(f))
        except (OSError, ValueError):
            pass
    status.fail(cls, message)
