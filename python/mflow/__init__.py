"""mflow from Python (a notebook, a script): run a spec, follow its events, read its record,
a stage's output and its metrics.

    import mflow

    result = mflow.run("specs/gpt-tp2.toml", overrides={"vars.iterations": 20}, on_event=mflow.EventPrinter())
    result.record.status                                   # "succeeded"
    mflow.output("specs/gpt-tp2.toml", "export")           # the exported model's directory
    mflow.metrics("specs/gpt-tp2.toml", "train").series    # the loss curve, one dict per line

Every function runs the mflow binary that came with this module (``MFLOW_BIN``, else the scripts
directory of the environment it is installed into, else ``PATH``): the module reads what the
binary prints and writes, and decides nothing itself.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version as _dist_version

from ._binary import find_binary
from ._cli import Overrides, output, plan, version
from ._metrics import StageMetrics, metrics
from ._run import Run, RunResult, run, start
from ._show import EventPrinter
from .errors import BinaryNotFound, CommandError, FormatError, MflowError, RunError
from .events import Event, parse_event
from .record import RunRecord, StageRecord, load_record

try:
    __version__ = _dist_version("mflow")
except PackageNotFoundError:  # the sources, not an installation
    __version__ = "0+unknown"

__all__ = [
    "BinaryNotFound",
    "CommandError",
    "Event",
    "EventPrinter",
    "FormatError",
    "MflowError",
    "Overrides",
    "Run",
    "RunError",
    "RunRecord",
    "RunResult",
    "StageMetrics",
    "StageRecord",
    "find_binary",
    "load_record",
    "metrics",
    "output",
    "parse_event",
    "plan",
    "run",
    "start",
    "version",
]
