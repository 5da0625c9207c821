"""MFLOW_MEGATRON_KNOBS: the names the Megatron engine knows, `default` and `none`, and a
misspelt knob refused with the known ones, not silently measured as off."""

import pytest

from mflow_workloads.errors import ConfigError
from mflow_workloads.megatron import trainer as MT


def test_default_none_and_additions():
    default = set(MT.DEFAULT_KNOBS.split(","))
    assert MT.parse_knobs(MT.DEFAULT_KNOBS) == default
    assert MT.parse_knobs("none") == set()
    assert MT.parse_knobs("") == set()
    assert MT.parse_knobs("default,compile_norm") == default | {"compile_norm"}
    assert MT.parse_knobs(" fused_adam , seq_parallel ") == {"fused_adam", "seq_parallel"}
    assert default <= MT.KNOWN_KNOBS


@pytest.mark.parametrize("bad", ["cuda_graph", "fused-adam", "default,ce_fusionn", "x" * 10_000])
def test_unknown_knobs_are_refused(bad):
    with pytest.raises(ConfigError) as e:
        MT.parse_knobs(bad)
    assert "MFLOW_MEGATRON_KNOBS" in str(e.value) and len(str(e.value)) < 200
    assert "fused_adam" in e.value.help
