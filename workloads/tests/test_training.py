"""Training on 2 gloo ranks: the loss goes down, outputs keep the shard layout, and a SIGKILL'd
run resumes from its newest checkpoint."""

import os
import subprocess

from conftest import REPO, python, read_json, read_jsonl, torchrun, train_config
from mflow_workloads import shards as S

VAL_DROP = 0.5  # nats; a 2-layer model learns the corpus' frequent tokens within 120 iterations


def test_train_120_iterations_lowers_val_loss(assets, tmp_path):
    run = str(tmp_path / "run")
    cfg = train_config(assets, run, iterations=120, eval_interval=20, save_interval=60)
    env = {
        "MFLOW_METRICS": os.path.join(run, "metrics.jsonl"),
        "MFLOW_STATUS": os.path.join(run, "status.json"),
        "MFLOW_PROGRESS": os.path.join(run, "progress.jsonl"),
    }
    proc = torchrun(2, ["-m", "mflow_workloads.train", cfg], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_jsonl(env["MFLOW_METRICS"])
    train = [x for x in lines if "loss" in x]
    val = [x for x in lines if "val_loss" in x]
    assert [x["iteration"] for x in train] == list(range(1, 121))
    assert set(train[0]) == {
        "iteration",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "tflops_per_gpu",
        "mem_gib",
        "time_s",
    }
    assert val[0]["val_loss"] - val[-1]["val_loss"] >= VAL_DROP, val
    progress = read_jsonl(env["MFLOW_PROGRESS"])
    assert progress[-1]["done"] == 120 and progress[-1]["total"] == 120 and progress[-1]["unit"] == "it"
    assert read_json(env["MFLOW_STATUS"])["checkpoint_iteration"] == 120
    out = os.path.join(run, "output")
    m_in, m_out = S.read_manifest(assets["sh2"]), S.read_manifest(out)
    assert m_out["tp"] == 2 and m_out["dtype"] == m_in["dtype"] and m_out["model"] == m_in["model"]
    for t in range(2):
        a, b = S.load_rank(assets["sh2"], m_in, t), S.load_rank(out, m_out, t)
        assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    assert os.path.isfile(os.path.join(out, "tokenizer", "tokenizer.json"))
    summary = read_json(os.path.join(out, "train_summary.json"))
    assert summary["iterations"] == 120
    # Nothing that differs between attempts is in the output: times and resumes are metrics.
    assert not set(summary) & set(S.ATTEMPT_FIELDS), summary
    attempt = [x for x in lines if "train_time_s" in x]
    assert len(attempt) == 1 and attempt[0]["resumed_from"] is None and attempt[0]["train_time_s"] > 0, attempt


def test_sigkill_one_rank_then_resume(assets, tmp_path):
    work = str(tmp_path)
    os.symlink(assets["data"], os.path.join(work, "data"))
    script = os.path.join(REPO, "tests", "gpu", "train_resume.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [python(), script, work, work, "reference", assets["sh2"], "40", "64", "fp32"],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = read_json(os.path.join(work, "resume_reference.json"))
    assert res["first_rc"] != 0, "the killed run must fail"
    assert res["killed_after_checkpoint"] >= 20
    assert res["summary"]["resumed_from"] >= res["killed_after_checkpoint"]
    assert res["resumed_first_iteration"] == res["summary"]["resumed_from"] + 1
    assert res["resumed_last_iteration"] == 40
    assert res["last_iteration_logged_before_kill"] - res["summary"]["resumed_from"] <= 10
    assert res["status"]["resumed_from"] == res["summary"]["resumed_from"]
    assert res["passed"]


def test_world_size_mismatch_is_a_clear_error(assets, tmp_path):
    cfg = train_config(assets, str(tmp_path / "run"), iterations=2)
    proc = torchrun(1, ["-m", "mflow_workloads.train", cfg])
    assert proc.returncode != 0
    assert "launched 1 processes but tp*pp*dp" in proc.stderr
