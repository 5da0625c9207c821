"""Arguments of the mflow command, and its commands that answer at once."""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ._binary import find_binary
from .errors import CommandError, MflowError

Overrides = Mapping[str, Any] | Iterable[str] | None
"""``--set`` overrides: a mapping of keys (``vars.iterations``, ``stages.train.lr``,
``pipeline.workdir``) to Python values, or ``KEY=VALUE`` strings as the command takes them."""


def toml_value(value: Any) -> str:
    """A Python value as the TOML text ``--set`` reads."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, (str, os.PathLike)):
        # A JSON string is a TOML basic string.
        return json.dumps(os.fspath(value), ensure_ascii=False)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise MflowError(f"an override cannot be {type(value).__name__}: give a bool, number, string, list or dict")


def set_args(overrides: Overrides) -> list[str]:
    """``--set KEY=VALUE`` for each override."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        pairs = [f"{k}={toml_value(v)}" for k, v in overrides.items()]
    elif isinstance(overrides, str):
        pairs = [overrides]
    else:
        pairs = list(overrides)
    return [a for p in pairs for a in ("--set", p)]


def env_with(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    return env


def call(args: list[str], *, cwd: str | Path | None = None, env: Mapping[str, str] | None = None) -> str:
    """Runs ``mflow ARGS``; its standard output. Raises :class:`CommandError` on a non-zero exit."""
    argv = [find_binary(), *args]
    p = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env_with(env), check=False)
    if p.returncode != 0:
        raise CommandError(argv, p.returncode, p.stderr)
    return p.stdout


def version() -> str:
    """The version of the mflow binary (``mflow --version``)."""
    return call(["--version"]).split()[-1]


def plan(
    spec: str | Path,
    *,
    overrides: Overrides = None,
    backend: str | None = None,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """What ``run`` would do with every stage, and why (``mflow plan --output-format json``)."""
    args = ["plan", os.fspath(spec), "--output-format", "json", *set_args(overrides)]
    if backend:
        args += ["--backend", backend]
    return json.loads(call(args, cwd=cwd, env=env))


def with_backend(overrides: Overrides, backend: str | None) -> list[str]:
    """The overrides as ``KEY=VALUE`` strings, with ``pipeline.backend`` where ``backend`` is given
    (what ``run --backend`` does, for the commands that have no such flag)."""
    pairs = set_args(overrides)[1::2]
    return [*pairs, f"pipeline.backend={toml_value(backend)}"] if backend else pairs


def output(
    spec: str | Path,
    stage: str,
    *,
    overrides: Overrides = None,
    backend: str | None = None,
    download: str | Path | None = None,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Path:
    """The committed output of ``stage`` (``mflow output SPEC STAGE``; ``overrides`` and
    ``backend`` as the run had them). With ``download``, the output is copied there (each file
    checked against its digest; from a cluster's volume too) and that directory is returned."""
    args = ["output", os.fspath(spec), stage, *set_args(with_backend(overrides, backend))]
    if download is not None:
        args += ["--download", os.fspath(download)]
    printed = call(args, cwd=cwd, env=env).strip().splitlines()
    if download is not None:
        return Path(download)
    if not printed:
        raise MflowError(f"mflow output {spec} {stage} printed no path")
    path = Path(printed[-1])
    return path if path.is_absolute() or cwd is None else Path(cwd) / path
