"""``mflow run SPEC --output-format json``: started, its events read as they come, its record
read at its end."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ._binary import find_binary
from ._cli import Overrides, env_with, set_args
from .errors import FormatError, RunError
from .events import Event, RunFinished, RunStarted, parse_event
from .record import RunRecord, StageRecord, load_record

STDERR_LINES = 400
"""The lines of standard error a result keeps (the last ones)."""


@dataclass
class RunResult:
    """How a run ended: its exit code (docs/exit-codes.md), every event, and its record
    (``None`` where the record is not readable here: a run started outside a Kubernetes cluster
    keeps it on the cluster's volume, where ``mflow status RUN --backend kubernetes`` shows it)."""

    spec: str
    exit_code: int
    events: list[Event] = field(default_factory=list, repr=False)
    record: RunRecord | None = None
    record_dir: Path | None = None
    stderr: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def run_id(self) -> str | None:
        return self.events[0].run if self.events else None

    @property
    def finished(self) -> RunFinished | None:
        """The run's last event: status, counts of stages and every gate."""
        return next((e for e in reversed(self.events) if isinstance(e, RunFinished)), None)

    def stage(self, name: str) -> StageRecord:
        """The record of stage ``name``."""
        if self.record is None:
            raise KeyError(f"run {self.run_id} has no record here")
        return self.record.stages[name]


class Run:
    """A run in progress: iterate over it for its events as they come; :meth:`wait` for its
    result. Leaving it early (an exception, a ``break`` followed by :meth:`close`, a ``with``
    block) stops mflow as Ctrl-C would: its stages are stopped and its record says so."""

    def __init__(self, argv: list[str], spec: str, env: Mapping[str, str], cwd: str | Path | None, echo: TextIO | None):
        self.argv, self.spec, self.echo, self.cwd = argv, spec, echo, cwd
        self.events: list[Event] = []
        self._stderr: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            errors="replace",
            cwd=cwd,
            env=dict(env),
        )
        self._drain = threading.Thread(target=self._read_stderr, daemon=True)
        self._drain.start()
        self._result: RunResult | None = None

    def _read_stderr(self) -> None:
        assert self._proc.stderr is not None
        for line in self._proc.stderr:
            self._stderr.append(line)
            if self.echo is not None:
                self.echo.write(line)
                self.echo.flush()

    def __iter__(self) -> Iterator[Event]:
        assert self._proc.stdout is not None
        try:
            for line in self._proc.stdout:
                ev = parse_event(line)
                if ev is not None:
                    self.events.append(ev)
                    yield ev
        except FormatError:
            self.close()
            raise

    def wait(self) -> RunResult:
        """Reads the events left, waits for mflow to end and reads the run's record."""
        if self._result is None:
            for _ in self:
                pass
            code = self._proc.wait()
            self._drain.join()
            self._result = RunResult(spec=self.spec, exit_code=code, events=self.events, stderr="".join(self._stderr))
            self._result.record_dir, self._result.record = _record_of(self.events, self.cwd)
        return self._result

    def close(self) -> None:
        """Stops mflow (SIGTERM: its stages are stopped, its record finished) and waits for it."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _record_of(events: list[Event], cwd: str | Path | None) -> tuple[Path | None, RunRecord | None]:
    """The record directory the events name, and its run.json where it can be read here."""
    named = [e.record for e in events if isinstance(e, (RunStarted, RunFinished))]
    if not named:
        return None, None
    d = Path(cwd or ".") / named[-1]
    try:
        return d, load_record(d)
    except OSError:
        return d, None


def start(
    spec: str | Path,
    stages: Iterable[str] = (),
    *,
    overrides: Overrides = None,
    backend: str | None = None,
    force: Iterable[str] = (),
    jobs: int | None = None,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    echo: TextIO | None = sys.stderr,
) -> Run:
    """Starts ``mflow run SPEC [STAGE...]`` and returns at once; iterate over the :class:`Run`
    for its events. ``stages``: only these and what they need. ``backend``: ``local`` or
    ``kubernetes`` (default: the spec's). ``force``: stages that run even if cached. ``echo``:
    where mflow's standard error goes as it comes (diagnostics, the provisioning of its Python
    environment), ``None`` for nowhere; the result keeps its end either way."""
    args = ["run", os.fspath(spec), *stages, "--output-format", "json", *set_args(overrides)]
    if backend:
        args += ["--backend", backend]
    for s in force:
        args += ["--force", s]
    if jobs is not None:
        args += ["--jobs", str(jobs)]
    return Run([find_binary(), *args], os.fspath(spec), env_with(env), cwd, echo)


def run(
    spec: str | Path,
    stages: Iterable[str] = (),
    *,
    overrides: Overrides = None,
    backend: str | None = None,
    force: Iterable[str] = (),
    jobs: int | None = None,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    on_event: Callable[[Event], Any] | None = None,
    echo: TextIO | None = sys.stderr,
    check: bool = True,
) -> RunResult:
    """Runs a spec to its end (the arguments are :func:`start`'s); ``on_event`` is called with
    every event as it comes. Raises :class:`RunError` when the run does not succeed, unless
    ``check`` is false."""
    with start(
        spec, stages, overrides=overrides, backend=backend, force=force, jobs=jobs, cwd=cwd, env=env, echo=echo
    ) as r:
        for ev in r:
            if on_event is not None:
                on_event(ev)
        result = r.wait()
    if check and not result.ok:
        raise RunError(result)
    return result
