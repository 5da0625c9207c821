"""The module with the real mflow binary on a small spec of command stages."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

import mflow
from conftest import installed_wheel
from mflow import events as ev


def test_the_binary_is_the_one_beside_the_module():
    found = Path(mflow.find_binary())
    assert found.is_file()
    if installed_wheel():
        # pip put the module into site-packages and the binary into the scripts directory.
        assert "site-packages" in Path(mflow.__file__).parts
        assert found.parent == Path(sysconfig.get_path("scripts"))
        assert mflow.version() == mflow.__version__


def test_mflow_bin_names_the_binary(monkeypatch, tmp_path):
    monkeypatch.setenv("MFLOW_BIN", str(tmp_path / "nothing"))
    with pytest.raises(mflow.BinaryNotFound, match="MFLOW_BIN="):
        mflow.find_binary()


def test_a_run_its_events_record_output_and_metrics(small_spec):
    shown = []
    result = mflow.run(small_spec, on_event=shown.append, echo=None)
    assert result.ok and result.exit_code == 0
    kinds = [type(e) for e in result.events]
    assert kinds[0] is ev.RunStarted and kinds[-1] is ev.RunFinished
    assert shown == result.events
    started = result.events[0]
    assert [s.name for s in started.stages] == ["count", "score"]
    assert {e.stage for e in result.events if isinstance(e, ev.StageSucceeded)} == {"count", "score"}
    assert "step 3 of 3" in [e.line for e in result.events if isinstance(e, ev.Output) and e.stage == "count"]
    assert len({e.run for e in result.events}) == 1 and result.run_id == started.run

    record = result.record
    assert record is not None and record.id == result.run_id
    assert record.status == "succeeded" and record.exit_code == 0 and record.order == ["count", "score"]
    assert record.mflow_version == mflow.version()
    assert result.stage("score").gates == [ev.GateResult(metric="score", condition="< 1", value=0.25, passed=True)]
    assert result.finished is not None and result.finished.counts.ran == 2
    assert result.finished.gates[0].stage == "score"

    out = mflow.output(small_spec, "count")
    assert (out / "numbers").read_text().split() == ["1", "2", "3"]
    assert str(out) == record.stages["count"].output

    m = mflow.metrics(small_spec, "count")
    assert m.run_id == result.run_id and m.summary is None
    assert m.values("loss") == [(1, 9.5), (2, 8.5), (3, 7.5)]
    assert m.table(("iteration", "loss")).splitlines() == [
        "iteration  loss",
        "        1   9.5",
        "        2   8.5",
        "        3   7.5",
    ]
    assert mflow.metrics(small_spec, "score").summary == {"score": 0.25, "total": 6}


def test_a_second_run_is_cached_and_its_metrics_come_from_the_run_that_computed_them(small_spec):
    first = mflow.run(small_spec, echo=None)
    again = mflow.run(small_spec, echo=None)
    assert again.finished is not None and again.finished.counts.cached == 2
    assert {e.stage for e in again.events if isinstance(e, ev.StageCached)} == {"count", "score"}
    assert again.stage("count").status == "cached"
    m = mflow.metrics(small_spec, "count")
    assert m.run_id == first.run_id and len(m.series) == 3


def test_overrides_reach_the_spec(small_spec):
    mflow.run(small_spec, echo=None)
    changed = mflow.run(small_spec, overrides={"vars.n": 5}, echo=None)
    assert changed.stage("count").status == "succeeded" and changed.stage("score").status == "succeeded"
    assert mflow.metrics(small_spec, "score", overrides={"vars.n": 5}).summary == {"score": 0.25, "total": 15}
    assert mflow.metrics(small_spec, "score").summary == {"score": 0.25, "total": 6}
    plan = mflow.plan(small_spec, overrides={"vars.n": 7})
    assert isinstance(plan, list) and {d["stage"] for d in plan} >= {"count", "score"}


def test_a_failed_gate_raises_with_the_result(small_spec):
    with pytest.raises(mflow.RunError) as failed:
        mflow.run(small_spec, overrides={"vars.score": 5}, echo=None)
    result = failed.value.result
    assert result.exit_code != 0 and result.record is not None and result.record.status == "failed"
    assert result.stage("score").failure_class == "gate"
    assert "gate score.score < 1: 5.0" in str(failed.value)
    unchecked = mflow.run(small_spec, overrides={"vars.score": 5}, echo=None, check=False)
    assert unchecked.exit_code == result.exit_code


def test_a_bad_spec_is_mflows_diagnostic(small_spec):
    with pytest.raises(mflow.RunError) as failed:
        mflow.run(small_spec, overrides={"vars.nope.x": 1}, echo=None)
    assert failed.value.result.record is None and failed.value.result.events == []
    assert "vars.nope.x" in failed.value.result.stderr


def test_a_run_left_early_is_stopped(tmp_path):
    spec = tmp_path / "slow.toml"
    spec.write_text('[pipeline]\nname = "slow"\n\n[stages.sleep]\nkind = "command"\nrun = ["sleep", "120"]\n')
    t0 = time.monotonic()
    with mflow.start(spec, echo=None) as r:
        for e in r:
            if isinstance(e, ev.AttemptStarted):
                break
    result = r.wait()
    assert time.monotonic() - t0 < 60
    assert result.exit_code != 0
    assert result.record is not None and result.record.status != "succeeded"
    assert result.stage("sleep").status != "succeeded"


def test_the_kubernetes_backend_is_asked_for(small_spec, tmp_path):
    # No cluster here: mflow says it cannot reach one, which it only tries for that backend.
    env = {"KUBECONFIG": str(tmp_path / "no-kubeconfig"), "HOME": str(tmp_path)}
    result = mflow.run(small_spec, backend="kubernetes", env=env, echo=None, check=False)
    assert result.exit_code != 0
    assert "kubeconfig" in result.stderr.lower() or "kubernetes" in result.stderr.lower()


def test_the_command_line_of_the_wheel(small_spec, tmp_path):
    # The binary the wheel installed is the command users type.
    out = subprocess.run(
        [mflow.find_binary(), "plan", str(small_spec)], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert "count" in out.stdout and "score" in out.stdout
    if installed_wheel():
        # Without MFLOW_BIN the module finds the binary its wheel installed.
        python = subprocess.run(
            [sys.executable, "-c", "import mflow; print(mflow.find_binary())"],
            capture_output=True,
            text=True,
            check=True,
            env={k: v for k, v in os.environ.items() if k != "MFLOW_BIN"},
        )
        assert Path(python.stdout.strip()) == Path(mflow.find_binary())
