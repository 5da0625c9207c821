"""`python -m mflow_workloads.doctor`: one JSON object describing the Python environment.

An absent package is null. So is one that is installed but fails to import or to answer; what it
raised is then under "errors", by package, so that `mflow doctor` says why.
"""

from __future__ import annotations

import importlib
import json
import platform
import sys
import warnings
from collections.abc import Callable
from typing import Any


def _probe(errors: dict[str, str], name: str, fn: Callable[[], Any]) -> Any:
    """fn(), or None when it fails; a failure other than the package's absence goes to `errors`."""
    try:
        return fn()
    except ModuleNotFoundError as e:
        if e.name != name.split(".")[0]:  # installed, but something it imports is not
            errors[name] = f"{type(e).__name__}: {e}"
        return None
    except Exception as e:  # noqa: BLE001 - a broken package is reported, whatever it raises
        errors[name] = f"{type(e).__name__}: {e}"
        return None


def _version(module: str) -> str:
    return getattr(importlib.import_module(module), "__version__", "unknown")


def _cuda_devices(torch) -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return []
    return [
        {
            "name": torch.cuda.get_device_name(i),
            "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
        }
        for i in range(torch.cuda.device_count())
    ]


def report() -> dict:
    errors: dict[str, str] = {}

    def version(module: str) -> str | None:
        return _probe(errors, module, lambda: _version(module))

    out = {
        "python": platform.python_version(),
        "torch": None,
        "cuda": None,
        "cuda_devices": [],
        "nccl": None,
        "megatron_core": None,
        "transformers": version("transformers"),
        "safetensors": version("safetensors"),
        "tokenizers": version("tokenizers"),
        "numpy": version("numpy"),
        "blake3": version("blake3"),
    }
    torch = _probe(errors, "torch", lambda: importlib.import_module("torch"))
    if torch is not None:
        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
        out["cuda_devices"] = _probe(errors, "torch.cuda", lambda: _cuda_devices(torch)) or []
        if out["cuda_devices"]:
            out["nccl"] = _probe(errors, "nccl", lambda: ".".join(map(str, torch.cuda.nccl.version())))
        out["gloo"] = torch.distributed.is_available() and torch.distributed.is_gloo_available()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["megatron_core"] = version("megatron.core")
    if errors:
        out["errors"] = errors
    return out


if __name__ == "__main__":
    json.dump(report(), sys.stdout)
    sys.stdout.write("\n")
