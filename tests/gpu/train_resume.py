"""Train, SIGKILL one rank after a checkpoint, relaunch, and check that the run resumed.

python tests/gpu/train_resume.py WORKDIR OUTDIR ENGINE SHARDS [ITERATIONS] [SEQ] [PRECISION]
Used on the GPU machine with ENGINE=megatron and on CPU with ENGINE=reference.
"""

import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config(work, run, engine, shards, iters, seq, precision):
    return {"stage": "train", "engine": engine, "shards": shards, "data": os.path.join(work, "data"),
            "output": os.path.join(run, "output"), "scratch": os.path.join(run, "scratch"), "tp": 2, "pp": 1,
            "dp": 1, "iterations": iters, "seq_length": seq, "micro_batch_size": 4, "global_batch_size": 8,
            "lr": 3e-3, "min_lr": 3e-4, "warmup_iterations": 5, "lr_decay": "cosine", "weight_decay": 0.1,
            "adam_beta1": 0.9, "adam_beta2": 0.95, "clip_grad": 1.0, "seed": 1234, "precision": precision,
            "save_interval": 10, "log_interval": 1, "eval_interval": 20, "eval_iters": 2, "attention": "sdpa"}


def launch(cfg_path, run, port):
    env = dict(os.environ, MFLOW_METRICS=os.path.join(run, "metrics.jsonl"),
               MFLOW_STATUS=os.path.join(run, "status.json"), MFLOW_PROGRESS=os.path.join(run, "progress.jsonl"),
               PYTHONPATH=os.path.join(ROOT, "workloads") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--node-rank=0",
           "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "mflow_workloads.train", cfg_path]
    return subprocess.Popen(cmd, env=env, start_new_session=True)


def workers(root_pid):
    """Worker processes (those running mflow_workloads.train) below the launcher, from /proc."""
    parent, cmd = {}, {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                parent[int(d)] = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
                cmd[int(d)] = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            except (OSError, IndexError, ValueError):
                pass
    below, frontier = set(), {root_pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - below
        below |= frontier
    return sorted(p for p in below if "mflow_workloads.train" in cmd.get(p, "") and p != root_pid)


def main():
    work, out, engine, shards = sys.argv[1:5]
    iters = int(sys.argv[5]) if len(sys.argv) > 5 else 60
    seq = int(sys.argv[6]) if len(sys.argv) > 6 else 128
    precision = sys.argv[7] if len(sys.argv) > 7 else "bf16"
    run = os.path.join(work, f"resume_{engine}")
    os.makedirs(run, exist_ok=True)
    cfg_path = os.path.join(run, "train.json")
    json.dump(config(work, run, engine, shards, iters, seq, precision), open(cfg_path, "w"))
    tracker = os.path.join(run, "scratch", "checkpoints", "latest_checkpointed_iteration.txt")
    t0 = time.time()
    p = launch(cfg_path, run, 29701)
    killed_after = None
    while p.poll() is None and time.time() - t0 < 400:
        if os.path.exists(tracker) and int(open(tracker).read() or 0) >= 20:
            killed_after = int(open(tracker).read())
            os.kill(workers(p.pid)[-1], signal.SIGKILL)
            break
        time.sleep(0.2)
    rc1 = p.wait()
    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    last_before = max(x["iteration"] for x in lines if "loss" in x)
    p2 = launch(cfg_path, run, 29702)
    rc2 = p2.wait()
    lines2 = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))][len(lines):]
    it2 = [x["iteration"] for x in lines2 if "loss" in x]
    # The output's summary, with the attempt's own figures (in its metrics: where it resumed).
    summary = json.load(open(os.path.join(run, "output", "train_summary.json"))) if rc2 == 0 else {}
    summary.update(next((x for x in reversed(lines2) if "train_time_s" in x), {}))
    res = {"engine": engine, "first_rc": rc1, "killed_after_checkpoint": killed_after,
           "last_iteration_logged_before_kill": last_before, "second_rc": rc2,
           "resumed_first_iteration": it2[0] if it2 else None, "resumed_last_iteration": it2[-1] if it2 else None,
           "status": json.load(open(os.path.join(run, "status.json"))), "summary": summary}
    res["passed"] = (rc1 != 0 and rc2 == 0 and killed_after is not None and summary.get("resumed_from") is not None
                     and summary["resumed_from"] >= killed_after and it2[0] == summary["resumed_from"] + 1
                     and it2[-1] == iters and last_before - summary["resumed_from"] <= 10)
    print("RESUME", json.dumps(res), flush=True)
    json.dump(res, open(os.path.join(out, f"resume_{engine}.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
