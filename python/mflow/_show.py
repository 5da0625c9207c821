"""Events as short lines for people, where a notebook shows a run going on."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from .events import (
    AttemptEnded,
    Event,
    GatesChecked,
    Progress,
    RunFinished,
    RunStarted,
    RunWarning,
    StageCached,
    StageFailed,
    StageSkipped,
    StageStarted,
    StageSucceeded,
)


class EventPrinter:
    """Prints the events of a run as lines (``run(..., on_event=EventPrinter())``): stages
    starting and ending, gates, warnings, the end; a stage's progress at most every
    ``every_s`` seconds, and its last."""

    def __init__(self, file: TextIO | None = None, every_s: float = 10.0):
        self.file, self.every_s = file, every_s
        self._last: dict[str, float] = {}

    def line(self, ev: Event) -> str | None:
        """The line of ``ev``, or ``None`` for an event not shown."""
        if isinstance(ev, RunStarted):
            return f"run {ev.run}: {ev.pipeline} ({', '.join(s.name for s in ev.stages)})"
        if isinstance(ev, StageCached):
            return f"  {ev.stage}: cached"
        if isinstance(ev, StageStarted):
            return f"> {ev.stage} started"
        if isinstance(ev, Progress):
            now, last = time.monotonic(), self._last.get(ev.stage)
            if ev.done != ev.total and last is not None and now - last < self.every_s:
                return None
            self._last[ev.stage] = now
            of = f"/{ev.total}" if ev.total is not None else ""
            return f"  {ev.stage} | {ev.label} {ev.done}{of} {ev.unit} {ev.message or ''}".rstrip()
        if isinstance(ev, AttemptEnded) and ev.outcome != "success":
            return f"  {ev.stage} attempt {ev.attempt}: {ev.outcome}: {ev.message or ''}".rstrip()
        if isinstance(ev, StageSucceeded):
            return f"+ {ev.stage} succeeded in {ev.duration_s:.1f}s"
        if isinstance(ev, StageFailed):
            return f"x {ev.stage} {ev.failure_class}: {ev.message}"
        if isinstance(ev, StageSkipped):
            return f"- {ev.stage} skipped: {ev.reason}"
        if isinstance(ev, GatesChecked):
            return "\n".join(
                f"  gate {ev.stage}.{g.metric} {g.condition}: {g.value} -> {'pass' if g.passed else 'FAIL'}"
                for g in ev.gates
            )
        if isinstance(ev, RunWarning):
            return f"! {ev.stage + ': ' if ev.stage else ''}{ev.message}"
        if isinstance(ev, RunFinished):
            c = ev.counts
            return f"run {ev.status}: {c.ran} ran, {c.cached} cached, {c.failed} failed, {c.skipped} skipped"
        return None

    def __call__(self, ev: Event) -> None:
        text = self.line(ev)
        if text:
            print(text, file=self.file or sys.stdout, flush=True)
