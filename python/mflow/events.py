"""The run events of ``mflow run --output-format json``: one JSON object per line, each an event
with the run it belongs to and when it happened. The types follow mflow's own
(``crates/mflow-contract/src/event.rs``); :func:`parse_event` reads a line into one of them.

A reader made for format :data:`FORMAT` reads every line of that format: keys it does not know
are left out, and an event it does not know is an :class:`UnknownEvent`. A line of a newer
format is refused (:class:`FormatError`): its meaning may have changed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from ._convert import from_json
from .errors import FormatError

FORMAT = 1
"""The format of event lines this module reads (their ``v``)."""

FailureClass = Literal["infra", "user", "oom", "timeout", "cancelled", "gate"]
"""Why an attempt failed; each class has its own retry budget."""

RunStatus = Literal["running", "succeeded", "failed", "cancelled", "interrupted"]

AttemptOutcome = Literal["success", "interrupted", "infra", "user", "oom", "timeout", "cancelled", "gate"]
"""How an attempt ended: ``success``, ``interrupted``, or its failure class."""


@dataclass(frozen=True, kw_only=True)
class EngineChoice:
    """The engine of a train or evaluate stage (or an export's verification), and why."""

    name: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class RunProcess:
    """The process that runs a run."""

    host: str
    pid: int
    start: int


@dataclass(frozen=True, kw_only=True)
class PlannedStage:
    name: str
    kind: str
    engine: EngineChoice | None = None


@dataclass(frozen=True, kw_only=True)
class Retry:
    """The retry that follows a failed attempt."""

    attempt: int
    after_s: float


@dataclass(frozen=True, kw_only=True)
class Counts:
    """Stages by how they ended."""

    ran: int = 0
    cached: int = 0
    failed: int = 0
    skipped: int = 0
    interrupted: int = 0


@dataclass(frozen=True, kw_only=True)
class GateResult:
    """One gate: ``metric condition`` against the stage's metrics.json."""

    metric: str
    condition: str
    value: float | None = None
    passed: bool


@dataclass(frozen=True, kw_only=True)
class StageGate(GateResult):
    """A gate of a stage, as the run's last event lists it."""

    stage: str


@dataclass(frozen=True, kw_only=True)
class Event:
    """One line of the stream: ``v`` (its format), ``run`` (the run's id), ``time`` (RFC 3339,
    UTC), and ``raw``, the line's whole JSON object (keys this module does not know included)."""

    name: ClassVar[str] = ""
    v: int
    run: str
    time: str
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class UnknownEvent(Event):
    """An event of a newer mflow that this module does not know; ``event`` is its name."""

    event: str = ""


@dataclass(frozen=True, kw_only=True)
class RunStarted(Event):
    """The run's record exists (``record`` is its directory); its stages in plan order."""

    name: ClassVar[str] = "run_started"
    pipeline: str
    spec: str
    record: str
    stages: list[PlannedStage]
    process: RunProcess | None = None


@dataclass(frozen=True, kw_only=True)
class StageCached(Event):
    """The stage's output was found in the cache (``by_another_run``: computed meanwhile by a
    run that held its key)."""

    name: ClassVar[str] = "stage_cached"
    stage: str
    key: str
    output: str
    digest: str
    by_another_run: bool = False


@dataclass(frozen=True, kw_only=True)
class StageKeyed(Event):
    """The stage's cache key is known."""

    name: ClassVar[str] = "stage_keyed"
    stage: str
    key: str


@dataclass(frozen=True, kw_only=True)
class StageSkipped(Event):
    """An upstream stage did not succeed."""

    name: ClassVar[str] = "stage_skipped"
    stage: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class StageCancelled(Event):
    """The run was cancelled before the stage started."""

    name: ClassVar[str] = "stage_cancelled"
    stage: str


@dataclass(frozen=True, kw_only=True)
class StageStarted(Event):
    """The stage holds its key and starts its first attempt."""

    name: ClassVar[str] = "stage_started"
    stage: str
    key: str


@dataclass(frozen=True, kw_only=True)
class AttemptStarted(Event):
    """``log``: the attempt's log, relative to the run's record directory."""

    name: ClassVar[str] = "attempt_started"
    stage: str
    attempt: int
    log: str
    engine: EngineChoice | None = None
    resumed_from: int | None = None


@dataclass(frozen=True, kw_only=True)
class Output(Event):
    """One line the stage printed (the attempt's log has every line)."""

    name: ClassVar[str] = "output"
    stage: str
    attempt: int
    line: str


@dataclass(frozen=True, kw_only=True)
class Progress(Event):
    """``eta_s``: seconds left, once the rate is known."""

    name: ClassVar[str] = "progress"
    stage: str
    attempt: int
    label: str
    done: int
    total: int | None = None
    unit: str
    message: str | None = None
    elapsed_s: float
    eta_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class AttemptEnded(Event):
    """How an attempt ended; ``metrics`` and ``verification`` are the stage's metrics.json and
    verification.json as the attempt left them."""

    name: ClassVar[str] = "attempt_ended"
    stage: str
    attempt: int
    outcome: AttemptOutcome
    message: str | None = None
    duration_s: float
    checkpoint_iteration: int | None = None
    resumed_from: int | None = None
    retry: Retry | None = None
    metrics: dict[str, Any] | None = None
    verification: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class GatesChecked(Event):
    """The stage's gates against its metrics.json."""

    name: ClassVar[str] = "gates_checked"
    stage: str
    gates: list[GateResult]
    metrics: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class StageSucceeded(Event):
    name: ClassVar[str] = "stage_succeeded"
    stage: str
    output: str
    digest: str
    duration_s: float


@dataclass(frozen=True, kw_only=True)
class StageFailed(Event):
    """The stage failed (or was cancelled: class ``cancelled``) and does not run again in this
    run. ``failure_class`` is the JSON's ``class``."""

    name: ClassVar[str] = "stage_failed"
    stage: str
    failure_class: FailureClass = field(metadata={"json": "class"})
    message: str


@dataclass(frozen=True, kw_only=True)
class StageInterrupted(Event):
    """mflow was interrupted while the stage ran on a cluster; its TrainJob keeps running."""

    name: ClassVar[str] = "stage_interrupted"
    stage: str
    message: str


@dataclass(frozen=True, kw_only=True)
class RunWarning(Event):
    """Something worth saying that changes nothing."""

    name: ClassVar[str] = "warning"
    stage: str | None = None
    message: str


@dataclass(frozen=True, kw_only=True)
class RunFinished(Event):
    """The run ended and its record is written (``record`` is its directory)."""

    name: ClassVar[str] = "run_finished"
    status: RunStatus
    exit_code: int
    counts: Counts
    gates: list[StageGate]
    record: str


EVENTS: dict[str, type[Event]] = {
    c.name: c
    for c in (
        RunStarted,
        StageCached,
        StageKeyed,
        StageSkipped,
        StageCancelled,
        StageStarted,
        AttemptStarted,
        Output,
        Progress,
        AttemptEnded,
        GatesChecked,
        StageSucceeded,
        StageFailed,
        StageInterrupted,
        RunWarning,
        RunFinished,
    )
}
"""Every event this module knows, by its name on the wire."""


def parse_event(line: str) -> Event | None:
    """One line of the stream as its event; ``None`` for a line that is no event (empty, or not
    a JSON object with ``v`` and ``event``). Raises :class:`FormatError` for a newer format."""
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("v"), int) or not isinstance(data.get("event"), str):
        return None
    if data["v"] > FORMAT:
        raise FormatError(
            f"mflow wrote an event of format {data['v']}; this module reads format {FORMAT} and older: "
            "install the mflow module of the same version as the binary (MFLOW_BIN)"
        )
    head = {"v": data["v"], "run": str(data.get("run", "")), "time": str(data.get("time", "")), "raw": data}
    cls = EVENTS.get(data["event"])
    if cls is not None:
        try:
            return from_json(cls, {**data, **head})
        except TypeError:
            pass  # a key the type needs is missing: kept whole, as an event of unknown shape
    return UnknownEvent(event=data["event"], **head)
