"""Evaluation against an HF baseline, and the export verification gate."""

import json
import os
import shutil
import subprocess

from safetensors.torch import load_file, save_file

from conftest import WORKLOADS, python, read_json, torchrun


def _eval_config(assets, out, tp=2):
    return {
        "stage": "evaluate",
        "engine": "reference",
        "shards": assets[f"sh{tp}"],
        "data": assets["data"],
        "output": out,
        "tp": tp,
        "pp": 1,
        "seq_length": 64,
        "micro_batch_size": 4,
        "eval_iters": 2,
        "splits": ["valid", "test"],
        "baseline": assets["hf"],
        "prompts": ["The license", "You may"],
        "max_new_tokens": 6,
        "precision": "fp32",
    }


def test_evaluate_matches_the_hf_baseline(assets, tmp_path):
    out = str(tmp_path / "out")
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(_eval_config(assets, out)))
    proc = torchrun(2, ["-m", "mflow_workloads.evaluate", str(path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = read_json(os.path.join(out, "metrics.json"))
    for k in (
        "val_loss",
        "val_ppl",
        "test_loss",
        "test_ppl",
        "baseline_val_loss",
        "baseline_val_ppl",
        "val_loss_delta_vs_baseline",
    ):
        assert isinstance(m[k], float), k
    assert abs(m["val_loss_delta_vs_baseline"]) < 1e-5  # the shards are the baseline, converted
    assert [s["prompt"] for s in m["samples"]] == ["The license", "You may"]
    assert all(isinstance(s["completion"], str) and s["completion"] for s in m["samples"])


def test_evaluate_refuses_a_tp_mismatch(assets, tmp_path):
    cfg = _eval_config(assets, str(tmp_path / "out"), tp=2)
    cfg["shards"] = assets["sh1"]
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(cfg))
    proc = torchrun(2, ["-m", "mflow_workloads.evaluate", str(path)])
    assert proc.returncode != 0 and "have tp=1 but evaluate was launched with tp=2" in proc.stderr


def _verify(assets, hf_dir, tmp_path):
    out = str(tmp_path / "verify")
    cfg = {
        "stage": "verify_export",
        "hf": hf_dir,
        "shards": assets["sh2"],
        "prompts": ["The license", "You may"],
        "max_new_tokens": 6,
        "output": out,
    }
    path = tmp_path / "verify.json"
    path.write_text(json.dumps(cfg))
    status = tmp_path / "status.json"
    env = dict(os.environ, PYTHONPATH=WORKLOADS, MFLOW_STATUS=str(status), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [python(), "-m", "mflow_workloads.verify_export", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, read_json(os.path.join(out, "verification.json")), status


def test_verify_export_passes_for_a_faithful_export(assets, tmp_path):
    proc, v, _ = _verify(assets, assets["hf"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert v["passed"] and v["greedy_match"] and v["max_abs_diff"] <= 1e-4


def test_verify_export_gate_fails_for_a_wrong_export(assets, tmp_path):
    bad = str(tmp_path / "hf_bad")
    shutil.copytree(assets["hf"], bad)
    w = load_file(os.path.join(bad, "model.safetensors"))
    w["model.layers.0.mlp.down_proj.weight"] = -w["model.layers.0.mlp.down_proj.weight"]
    save_file(w, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    proc, v, status = _verify(assets, bad, tmp_path)
    assert proc.returncode != 0
    assert not v["passed"] and v["max_abs_diff"] > 1e-3
    assert read_json(status)["class"] == "gate"
    assert "export verification failed" in proc.stderr
