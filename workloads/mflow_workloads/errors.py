"""Errors a workload reports to its user: each names the file, key or tensor and says what to do."""

from __future__ import annotations


class WorkloadError(Exception):
    """A failure with a stable code, a failure class for mflow, and a hint for the user."""

    code = "mflow::workload"
    cls = "user"

    def __init__(self, message: str, help: str | None = None):
        super().__init__(message)
        self.help = help

    def render(self) -> str:
        out = f"error[{self.code}]: {self}"
        if self.help:
            out += f"\n  help: {self.help}"
        return out


class ConfigError(WorkloadError):
    code = "mflow::workload::config"


class ShardsError(WorkloadError):
    code = "mflow::workload::shards"


class DatasetError(WorkloadError):
    code = "mflow::workload::dataset"


class CheckpointError(WorkloadError):
    code = "mflow::workload::checkpoint"


class ParallelError(WorkloadError):
    code = "mflow::workload::parallel"


class GateError(WorkloadError):
    code = "mflow::workload::gate"
    cls = "gate"
