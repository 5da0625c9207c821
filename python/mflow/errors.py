"""What the module raises; every error is an :class:`MflowError`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._run import RunResult


class MflowError(Exception):
    """An error of the mflow module or of the mflow command it ran."""


class BinaryNotFound(MflowError):
    """No mflow binary: not beside the module, not at MFLOW_BIN, not on PATH."""


class FormatError(MflowError):
    """A line or record of a newer format than this module reads."""


class CommandError(MflowError):
    """An mflow command other than ``run`` failed: ``exit_code`` and its ``stderr``."""

    def __init__(self, argv: list[str], exit_code: int, stderr: str):
        self.argv, self.exit_code, self.stderr = argv, exit_code, stderr
        shown = " ".join(argv[1:3])
        super().__init__(f"mflow {shown} ... exited with {exit_code}:\n{stderr.strip()}")


class RunError(MflowError):
    """``mflow run`` did not succeed; ``result`` has its events, record and standard error."""

    def __init__(self, result: RunResult):
        self.result = result
        lines = [f"mflow run {result.spec} exited with {result.exit_code}"]
        if result.record is not None:
            for name in result.record.order:
                s = result.record.stages.get(name)
                if s is not None and s.status in ("failed", "cancelled", "interrupted"):
                    cls = f"{s.failure_class}: " if s.failure_class else ""
                    lines.append(f"  stage {name} {s.status}: {cls}{s.message or ''}")
            lines += [
                f"  gate {st}.{g.metric} {g.condition}: {g.value}" for st, g in result.record.gates() if not g.passed
            ]
        tail = result.stderr.strip().splitlines()[-15:]
        if tail:
            lines += ["standard error (end):", *(f"  {t}" for t in tail)]
        super().__init__("\n".join(lines))
