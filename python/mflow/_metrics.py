"""A stage's metrics: the metrics.json its output holds (what its gates read), and the lines it
appended to ``MFLOW_METRICS`` while it ran (``stages/<stage>/metrics.jsonl`` in the record of the
run that computed the output: the loss curve of a training stage)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._cli import Overrides, call, output, set_args, with_backend
from ._run import RunResult
from .errors import MflowError
from .record import load_record


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


def _read_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                v = json.loads(line)
            except ValueError:
                continue
            if isinstance(v, dict):
                out.append(v)
    return out


def _producing_run(
    workdir: Path, stage: str, digest: str, first: RunResult | None, env: Mapping[str, str] | None
) -> tuple[str, Path] | None:
    """The newest run of ``workdir`` (``first`` before the others) in which ``stage`` ran and
    committed the output of ``digest``: its id and record directory."""
    candidates: list[Path] = []
    if first is not None and first.record_dir is not None:
        candidates.append(first.record_dir)
    listed = call(["runs", "--workdir", os.fspath(workdir), "--output-format", "json"], env=env)
    ids = sorted((json.loads(line)["id"] for line in listed.splitlines() if line.strip()), reverse=True)
    # The record directories of a workdir: WORKDIR/runs/<id> (docs/formats.md).
    candidates += [workdir / "runs" / i for i in ids]
    for d in candidates:
        try:
            s = load_record(d).stages.get(stage)
        except (OSError, ValueError):
            continue
        if s is not None and s.status == "succeeded" and s.output_digest == digest:
            return d.name, d
    return None


def metrics(
    spec: str | Path,
    stage: str,
    *,
    overrides: Overrides = None,
    backend: str | None = None,
    run: RunResult | None = None,
    download: str | Path | None = None,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> StageMetrics:
    """The metrics of ``stage``'s current output (``overrides`` and ``backend`` as the run had
    them). ``run``: a result to look in first for the lines. ``download``: where the output of a
    run whose output is not readable here (a cluster's volume) is copied to first; its series
    stay on the volume."""
    overrides = with_backend(overrides, backend)
    if download is not None:
        out = output(spec, stage, overrides=overrides, download=download, cwd=cwd, env=env)
        return StageMetrics(stage=stage, output=out, summary=_summary(out))
    args = ["output", os.fspath(spec), stage, "--output-format", "json", *set_args(overrides)]
    answer = json.loads(call(args, cwd=cwd, env=env).splitlines()[-1])
    out = Path(cwd or ".") / answer["path"]
    if not out.is_dir():
        raise MflowError(
            f"the output of {stage} is at {out}, which is not here (a cluster's volume?): pass download=DIR"
        )
    # A committed output is WORKDIR/cache/<key> (docs/formats.md).
    found = _producing_run(out.parent.parent, stage, answer.get("digest", ""), run, env)
    m = StageMetrics(stage=stage, output=out, summary=_summary(out))
    if found is not None:
        m.run_id, record_dir = found
        lines = record_dir / "stages" / stage / "metrics.jsonl"
        m.series = _read_lines(lines) if lines.is_file() else []
    return m


def _summary(out: Path) -> dict[str, Any] | None:
    p = out / "metrics.json"
    if not p.is_file():
        return None
    with open(p, encoding="utf-8") as f:
        v = json.load(f)
    return v if isinstance(v, dict) else None
