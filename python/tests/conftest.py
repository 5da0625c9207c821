"""Fixtures of the mflow module's tests: a small spec of command stages that the real mflow
binary runs in a temporary directory (no Python environment, no torch needed).

The tests import the installed module (``pip install`` of the wheel: scripts/test-python), or
the sources with ``MFLOW_BIN`` set to a binary (``PYTHONPATH=python``)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

COUNT = """\
#!/bin/sh
# count N: N metric lines (a falling loss), N lines of output, the numbers 1..N as the output.
n=$1
i=1
while [ "$i" -le "$n" ]; do
  echo "{\\"iteration\\": $i, \\"loss\\": $((10 - i)).5}" >> "$MFLOW_METRICS"
  echo "step $i of $n"
  i=$((i + 1))
done
seq 1 "$n" > "$MFLOW_OUTPUT/numbers"
"""

SCORE = """\
#!/bin/sh
# score S: metrics.json with S and the sum of the numbers of stage count.
total=$(awk '{ s += $1 } END { print s }' "$MFLOW_INPUT_COUNT/numbers")
echo "{\\"score\\": $1, \\"total\\": $total}" > "$MFLOW_OUTPUT/metrics.json"
"""


@pytest.fixture
def small_spec(tmp_path: Path) -> Path:
    """A spec of two command stages: ``count`` (metric lines, output lines, a file) and
    ``score`` (needs count; a metrics.json gated by ``score < 1``). Vars: ``n``, ``score``."""
    (tmp_path / "count.sh").write_text(COUNT)
    (tmp_path / "score.sh").write_text(SCORE)
    spec = tmp_path / "small.toml"
    spec.write_text(
        textwrap.dedent(
            f"""\
            [pipeline]
            name = "small"

            [vars]
            n = 3
            score = 0.25

            [stages.count]
            kind = "command"
            inputs = ["count.sh"]
            run = ["sh", "-c", "sh {tmp_path}/count.sh ${{vars.n}}"]

            [stages.score]
            kind = "command"
            needs = ["count"]
            inputs = ["score.sh"]
            run = ["sh", "-c", "sh {tmp_path}/score.sh ${{vars.score}}"]

            [stages.score.gates]
            score = "< 1"
            """
        )
    )
    return spec


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CI reporters, no colour: the run as a notebook sees it."""
    for var in ("GITHUB_STEP_SUMMARY", "MFLOW_WORKDIR", "MFLOW_BACKEND", "MFLOW_OUTPUT_FORMAT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_COLOR", "1")


def installed_wheel() -> bool:
    """Whether these tests check an installed wheel (scripts/test-python sets it)."""
    return os.environ.get("MFLOW_TEST_WHEEL", "") == "1"
