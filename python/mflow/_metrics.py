"""A stage's metrics: the metrics.json its output holds (what its gates read), and the lines it
appended to ``MFLOW_METRICS`` while it ran (``stages/<stage>/metrics.jsonl`` in the record of the
run that computed the output: the loss curve of a training stage), as ``mflow metrics show``
gives them."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._cli import Overrides, call, output, set_args, with_backend


@dataclass
class StageMetrics:
    """``summary``: the output's metrics.json (``None`` where it has none); ``series``: one dict
    per metrics line, in order, from run ``run_id`` (empty where no record here has them)."""

    stage: str
    output: Path
    summary: dict[str, Any] | None = None
    series: list[dict[str, Any]] = field(default_factory=list)
    run_id: str | None = None

    def values(self, key: str) -> list[tuple[Any, float]]:
        """``(iteration, value)`` of every line that has ``key`` (iteration ``None`` where a line
        has none)."""
        return [(m.get("iteration"), m[key]) for m in self.series if isinstance(m.get(key), (int, float))]

    def table(self, keys: Sequence[str] = ("iteration", "loss", "val_loss"), every: int = 1) -> str:
        """The series as a text table of ``keys``: every ``every``-th line that has any of them
        beyond the first, and the last."""
        rows = [m for m in self.series if any(k in m for k in keys[1:])]
        rows = [m for i, m in enumerate(rows) if i % max(every, 1) == 0 or i == len(rows) - 1]
        cells = [list(keys)] + [[_cell(m.get(k)) for k in keys] for m in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(keys))]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells)


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def metrics(
    spec: str | Path,
    stage: str,
    *,
    overrides: Overrides = None,
    backend: str | None = None,
    download: str | Path | None = None,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> StageMetrics:
    """The metrics of ``stage``'s current output (``overrides`` and ``backend`` as the run had
    them), as ``mflow metrics show`` answers: the summary and the lines of the newest run that
    computed the output, from a cluster's volume too. ``download``: where the output itself is
    copied to first (``output`` is then that directory, else the output's path, which outside a
    cluster is on its volume)."""
    overrides = with_backend(overrides, backend)
    args = ["metrics", "show", os.fspath(spec), stage, "--output-format", "json", *set_args(overrides)]
    answer = json.loads(call(args, cwd=cwd, env=env).splitlines()[-1])
    out = Path(cwd or ".") / answer["path"]
    if download is not None:
        out = output(spec, stage, overrides=overrides, download=download, cwd=cwd, env=env)
    summary = answer.get("summary")
    return StageMetrics(
        stage=stage,
        output=out,
        summary=summary if isinstance(summary, dict) else None,
        series=[m for m in answer.get("series") or [] if isinstance(m, dict)],
        run_id=answer.get("run"),
    )
