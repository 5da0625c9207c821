"""The notebook examples/notebooks/mflow-pipeline.ipynb, executed headless by Papermill as
Kubeflow's notebook runs are: the main pipeline with the local backend, few iterations and
gates to match, its loss curve, gates and exported model. Its kernel is this interpreter: it
needs transformers and torch (scripts/test-python gives the venv the stage environment's), and
the notebook's install cell installs ``MFLOW_WHEEL``, the wheel under test."""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebooks" / "mflow-pipeline.ipynb"


def outputs(nb, cell_id: str) -> str:
    cell = next(c for c in nb.cells if c.get("id") == cell_id)
    text = []
    for o in cell.outputs:
        if o.output_type == "stream":
            text.append(o.text)
        elif o.output_type in ("execute_result", "display_data"):
            text.append(o.data.get("text/plain", ""))
    return "".join(text)


def test_the_notebook_runs_the_main_pipeline_headless(tmp_path):
    papermill = pytest.importorskip("papermill", reason="the test tools of python/requirements-dev.txt")
    if not os.environ.get("MFLOW_WHEEL"):
        pytest.skip("the notebook installs the wheel under test (scripts/test-python sets MFLOW_WHEEL), not PyPI's")
    try:
        import transformers  # noqa: F401
    except ImportError:
        pytest.fail("the notebook loads the exported model with transformers: run this from scripts/test-python")
    params = {
        "backend": "local",
        "iterations": 20,
        "tp_size": 2,
        "pp_size": 1,
        "num_nodes": 1,
        "workdir": str(tmp_path / "work"),
        "gates": {"val_ppl": "< 200", "val_loss_delta_vs_baseline": "< -1.0"},
        "mflow_wheel": os.environ["MFLOW_WHEEL"],
    }
    t0 = time.monotonic()
    nb = papermill.execute_notebook(
        str(NOTEBOOK),
        str(tmp_path / "out.ipynb"),
        parameters=params,
        kernel_name="python3",
        cwd=str(NOTEBOOK.parent),
        progress_bar=False,
    )
    took = time.monotonic() - t0
    print(f"the notebook ran in {took:.0f}s")

    run = outputs(nb, "run")
    assert "run succeeded: 7 ran, 0 cached" in run, run
    assert "gate evaluate.val_ppl < 200" in run
    plan = outputs(nb, "plan")
    assert "train" in plan and "export" in plan
    gates = outputs(nb, "gates")
    assert "evaluate.val_loss_delta_vs_baseline < -1.0" in gates and "-> pass" in gates
    assert "FAIL" not in gates
    loss = next(c for c in nb.cells if c.get("id") == "loss")
    try:
        import matplotlib  # noqa: F401

        images = [o.data["image/png"] for o in loss.outputs if "image/png" in o.get("data", {})]
        assert images and base64.b64decode(images[0])[:4] == b"\x89PNG", "the loss curve is drawn"
    except ImportError:
        assert "iteration" in outputs(nb, "loss") and "loss" in outputs(nb, "loss")
    model = outputs(nb, "model")
    assert "generated: 'fn main() {" in model, model
