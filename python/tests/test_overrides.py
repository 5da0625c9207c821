"""Python values as the TOML text ``--set`` reads: each read back by a TOML parser."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]

from mflow import MflowError
from mflow._cli import set_args, toml_value

VALUES = [
    0,
    -7,
    2**40,
    0.003,
    1e-12,
    True,
    False,
    "< 200",
    "word",
    'quo"te \\ back',
    "line\nbreak\ttab",
    "ünïcode ✓",
    ["hello", "fn main() {"],
    [1, 2.5, [True]],
    {"a": 1, "b c": ["x"]},
]


@pytest.mark.skipif(tomllib is None, reason="tomllib is Python 3.11's")
@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_a_value_reads_back_as_itself(value):
    assert tomllib.loads(f"x = {toml_value(value)}")["x"] == value


@pytest.mark.skipif(tomllib is None, reason="tomllib is Python 3.11's")
def test_special_floats_and_paths():
    assert math.isinf(tomllib.loads(f"x = {toml_value(float('-inf'))}")["x"])
    assert math.isnan(tomllib.loads(f"x = {toml_value(float('nan'))}")["x"])
    assert tomllib.loads(f"x = {toml_value(Path('/tmp/w d'))}")["x"] == "/tmp/w d"


def test_overrides_as_a_mapping_or_as_the_command_takes_them():
    assert set_args({"vars.n": 3, "stages.b.gates.score": "< 1"}) == [
        "--set",
        "vars.n=3",
        "--set",
        'stages.b.gates.score="< 1"',
    ]
    assert set_args(["vars.n=3", "vars.m=x"]) == ["--set", "vars.n=3", "--set", "vars.m=x"]
    assert set_args("vars.n=3") == ["--set", "vars.n=3"]
    assert set_args(None) == []
    with pytest.raises(MflowError, match="cannot be NoneType"):
        toml_value(None)
