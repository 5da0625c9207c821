"""The run record, ``run.json`` in a run's record directory: every stage and attempt of one run.
The types follow mflow's own (``crates/mflow-contract/src/record.rs``); keys this module does not
know are left out, and a record of a newer format is refused (:class:`FormatError`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ._convert import from_json
from .errors import FormatError
from .events import AttemptOutcome, EngineChoice, FailureClass, GateResult, RunProcess, RunStatus

FORMAT = 1
"""The format of run.json this module reads (its ``format``; records older than the field are 0)."""

StageStatus = Literal["pending", "running", "cached", "succeeded", "failed", "skipped", "cancelled", "interrupted"]


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One attempt of a stage; ``log`` is relative to the run's record directory."""

    n: int
    started: str
    finished: str | None = None
    duration_s: float | None = None
    outcome: AttemptOutcome | None = None
    message: str | None = None
    log: str
    resumed_from: int | None = None
    checkpoint_iteration: int | None = None


@dataclass(frozen=True, kw_only=True)
class StageRecord:
    """One stage of a run. ``failure_class`` is the JSON's ``class``; ``metrics`` and
    ``verification`` hold selected contents of the stage's metrics.json / verification.json."""

    kind: str
    status: StageStatus
    key: str | None = None
    output: str | None = None
    output_digest: str | None = None
    started: str | None = None
    finished: str | None = None
    duration_s: float | None = None
    attempts: list[Attempt] = field(default_factory=list)
    message: str | None = None
    failure_class: FailureClass | None = field(default=None, metadata={"json": "class"})
    gates: list[GateResult] = field(default_factory=list)
    metrics: dict[str, Any] | None = None
    verification: dict[str, Any] | None = None
    engine: EngineChoice | None = None


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """run.json: ``order`` is the stages in planned order, ``stages`` each stage by name."""

    format: int = 0
    id: str
    pipeline: str
    spec: str
    started: str
    finished: str | None = None
    status: RunStatus
    exit_code: int | None = None
    mflow_version: str
    process: RunProcess | None = None
    stages: dict[str, StageRecord] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)

    def gates(self) -> list[tuple[str, GateResult]]:
        """Every gate of every stage as ``(stage, gate)``, in planned order."""
        return [(name, g) for name in self.order if name in self.stages for g in self.stages[name].gates]


def record_from_json(data: dict[str, Any]) -> RunRecord:
    """A run record from the JSON object of a run.json."""
    fmt = data.get("format", 0)
    if not isinstance(fmt, int) or fmt > FORMAT:
        raise FormatError(
            f"the run record is of format {fmt}; this module reads format {FORMAT} and older: "
            "install the mflow module of the same version as the binary (MFLOW_BIN)"
        )
    return from_json(RunRecord, data)


def load_record(path: str | Path) -> RunRecord:
    """The record in ``path``: a run.json, or a run's record directory holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / "run.json"
    with open(p, encoding="utf-8") as f:
        return record_from_json(json.load(f))
