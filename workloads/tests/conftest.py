import json
import os
import subprocess
import sys

import pytest

import fixtures_lib as FL

# pytest imports mflow_workloads from WORKLOADS (pythonpath in workloads/pyproject.toml).
HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = os.path.dirname(HERE)
REPO = os.path.dirname(WORKLOADS)


def read_json(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_jsonl(path: str) -> list:
    """The JSON lines of a metrics, progress or status-style file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(x) for x in f]


def python() -> str:
    return os.environ.get("MFLOW_PYTHON", sys.executable)


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """A BPE tokenizer, a tiny HF Llama (GQA), its mflow shards at tp=1 and tp=2, and a dataset."""
    d = tmp_path_factory.mktemp("assets")
    tok = FL.make_tokenizer(str(d / "tok"))
    hf = FL.make_hf_model(str(d / "hf"), tok, arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128)
    return {
        "dir": d,
        "tok": tok,
        "hf": hf,
        "data": FL.make_dataset(str(d / "data"), tok),
        "sh1": FL.convert_hf_to_shards(hf, str(d / "sh1"), 1),
        "sh2": FL.convert_hf_to_shards(hf, str(d / "sh2"), 2),
    }


_port = [29400 + os.getpid() % 500]


def torchrun(nproc: int, args: list[str], env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Launches `python -m torch.distributed.run` the way mflow does, on gloo."""
    _port[0] += 1
    full_env = dict(
        os.environ,
        PYTHONPATH=WORKLOADS + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
    )
    full_env.update(env or {})
    cmd = [
        python(),
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--node-rank=0",
        "--master-addr=127.0.0.1",
        f"--master-port={_port[0]}",
        *args,
    ]
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)


def train_config(assets, run_dir, **over) -> str:
    cfg = {
        "stage": "train",
        "engine": "reference",
        "shards": assets["sh2"],
        "data": assets["data"],
        "output": os.path.join(run_dir, "output"),
        "scratch": os.path.join(run_dir, "scratch"),
        "tp": 2,
        "pp": 1,
        "dp": 1,
        "iterations": 20,
        "seq_length": 64,
        "micro_batch_size": 4,
        "global_batch_size": 8,
        "lr": 3e-3,
        "min_lr": 3e-4,
        "warmup_iterations": 5,
        "lr_decay": "cosine",
        "weight_decay": 0.1,
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "clip_grad": 1.0,
        "seed": 1234,
        "precision": "fp32",
        "save_interval": 10,
        "log_interval": 1,
        "eval_interval": 10,
        "eval_iters": 2,
        "attention": "sdpa",
    }
    cfg.update(over)
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "train.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path
