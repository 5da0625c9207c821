"""Progress, metrics and status files shared with mflow (see crates/mflow-progress).

Progress and metrics are JSON lines appended to the files named by MFLOW_PROGRESS and
MFLOW_METRICS. The status file (MFLOW_STATUS) holds one JSON object that is rewritten
atomically, so that mflow never reads half of it.
"""

from __future__ import annotations

import errno
import json
import math
import os
import time
from typing import Any

MIN_PROGRESS_INTERVAL_S = 0.2  # at most ~5 lines per second


def _append_line(path: str | None, obj: dict[str, Any]) -> None:
    if not path:
        return
    line = json.dumps(_finite(obj), separators=(",", ":")) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)


def _finite(obj: dict[str, Any]) -> dict[str, Any]:
    # JSON has no NaN/inf; a diverged loss is reported as null rather than breaking the reader.
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in obj.items()}


class Progress:
    """Appends `{"label","done","total","unit","message"}` lines, throttled."""

    def __init__(self, label: str, total: int | None, unit: str, enabled: bool = True):
        self.label, self.total, self.unit = label, total, unit
        self.path = os.environ.get("MFLOW_PROGRESS") if enabled else None
        self._last = 0.0

    def update(self, done: int, message: str | None = None, force: bool = False) -> None:
        if not self.path:
            return
        now = time.monotonic()
        if not force and now - self._last < MIN_PROGRESS_INTERVAL_S:
            return
        self._last = now
        event: dict[str, Any] = {"label": self.label, "done": int(done), "unit": self.unit}
        if self.total is not None:
            event["total"] = int(self.total)
        if message:
            event["message"] = message
        _append_line(self.path, event)


class Metrics:
    """Appends one JSON object per line to MFLOW_METRICS."""

    def __init__(self, enabled: bool = True):
        self.path = os.environ.get("MFLOW_METRICS") if enabled else None

    def write(self, **fields: Any) -> None:
        _append_line(self.path, fields)


class Status:
    """Keeps MFLOW_STATUS up to date: checkpoint_iteration, resumed_from, failure class."""

    def __init__(self, enabled: bool = True):
        self.path = os.environ.get("MFLOW_STATUS") if enabled else None
        self.state: dict[str, Any] = {"checkpoint_iteration": None, "resumed_from": None}

    def update(self, **fields: Any) -> None:
        self.state.update(fields)
        if not self.path:
            return
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(_finite(self.state), f)
        os.replace(tmp, self.path)

    def fail(self, cls: str, message: str) -> None:
        self.update(**{"class": cls, "message": message[:2000]})


# The rule of docs/exit-codes.md, as mflow applies it to a system call's error: what may pass
# by itself is infra, what the same attempt meets again is user.
_PASSING_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EAGAIN",
        "EINTR",
        "ENOMEM",
        "EMFILE",
        "ENFILE",
        "ENOSPC",
        "EDQUOT",
        "EROFS",
        "EBUSY",
        "ETXTBSY",
        "EIO",
        "ESTALE",
        "ECONNREFUSED",
        "ECONNRESET",
        "ECONNABORTED",
        "ENOTCONN",
        "EPIPE",
        "ETIMEDOUT",
        "EHOSTUNREACH",
        "EHOSTDOWN",
        "ENETUNREACH",
        "ENETDOWN",
        "ENETRESET",
        "EADDRNOTAVAIL",
    )
    if hasattr(errno, name)
)

# Errors of the collective backends, which say a peer or the network failed.
_COLLECTIVE_WORDS = ("nccl", "gloo", "rendezvous", "connection reset", "connection closed", "broken pipe")
# Storage that failed under the stage, as libraries that wrap the OS error say it (safetensors:
# "I/O error: No space left on device (os error 28)"; torch.save: "file write failed").
STORAGE_WORDS = (
    *(os.strerror(e).lower() for e in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ESTALE)),
    "file write failed",
)


def classify_exception(exc: BaseException) -> str:
    """Maps an exception to mflow's failure classes (docs/exit-codes.md): oom, infra, user."""
    from .errors import WorkloadError

    if isinstance(exc, WorkloadError):
        return exc.cls
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return "oom"
    # A system call's error by its number, never by the words around it (a file named
    # peer-timeout.bin that does not exist is the user's).
    if isinstance(exc, OSError) and exc.errno is not None:
        return "infra" if exc.errno in _PASSING_ERRNOS else "user"
    # InterruptedError: the workload's own word for a SIGTERM from outside, after its checkpoint.
    if isinstance(exc, (TimeoutError, ConnectionError, InterruptedError)):
        return "infra"
    if type(exc).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError"):
        return "infra"
    if any(w in str(exc).lower() for w in STORAGE_WORDS):
        return "infra"
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        # torch raises CUDA's out-of-memory and the collectives' failures as RuntimeError.
        if "out of memory" in text:
            return "oom"
        if any(w in text for w in _COLLECTIVE_WORDS):
            return "infra"
    return "user"
