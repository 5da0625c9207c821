"""`python -m mflow_workloads.doctor`: one JSON object describing the Python environment."""

from __future__ import annotations

import json
import platform
import sys


def _version(module: str):
    try:
        mod = __import__(module, fromlist=["__version__"])
        return getattr(mod, "__version__", "unknown")
    except Exception:  # noqa: BLE001 - absent or broken packages are reported as null
        return None


def report() -> dict:
    out = {"python": platform.python_version(), "torch": None, "cuda": None, "cuda_devices": [], "nccl": None,
           "megatron_core": None, "transformers": _version("transformers"), "safetensors": _version("safetensors"),
           "tokenizers": _version("tokenizers"), "numpy": _version("numpy"), "blake3": _version("blake3")}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            out["cuda_devices"] = [{"name": torch.cuda.get_device_name(i),
                                    "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                                   for i in range(torch.cuda.device_count())]
            try:
                out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            except Exception:  # noqa: BLE001
                out["nccl"] = None
        out["gloo"] = torch.distributed.is_available() and torch.distributed.is_gloo_available()
    except Exception:  # noqa: BLE001
        pass
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["megatron_core"] = _version("megatron.core")
    return out


if __name__ == "__main__":
    json.dump(report(), sys.stdout)
    sys.stdout.write("\n")
