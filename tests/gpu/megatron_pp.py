"""The Megatron engine's pipeline/data-parallel code path on one GPU (tp = pp = dp = 1, several
micro-batches through get_forward_backward_func), through mflow_workloads.train.

python tests/gpu/megatron_pp.py WORKDIR OUTDIR

1. unchanged: the workloads of another commit (.before/mflow_workloads, when present: see
   megatron_pp.sh) and these train the same 30 bf16 iterations (4 micro-batches per step); the
   grad norms must be equal, and the losses and validation losses BEFORE_LOSS_SCALE times the
   other engine's (default 1; 4 against 248827f and older engines, which reported the loss after
   Megatron's schedule had divided it by the number of micro-batches in place: exact in binary).
2. resume: the same run restarted from its checkpoint at 20 repeats iterations 21-30 (losses
   within 1e-5).
3. reference: on the reference engine's samples (the Megatron engine's dataset is replaced by
   data.SampleSource, read at the same data.first_sample positions), fp32, untied and tied, the
   first step's loss equals the reference engine's on the same GPU within 1e-5 and the first 5
   within 1e-3.
One JSON line per check, a summary in OUTDIR/megatron_pp.json; exit 1 if any check fails.
"""

import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKLOADS = os.path.join(ROOT, "workloads")
sys.path.insert(0, os.path.join(WORKLOADS, "tests"))
sys.path.insert(0, WORKLOADS)

MODEL = dict(arch="llama", layers=4, hidden=256, heads=8, kv_heads=2, ffn=704)


def config(work, run, shards, engine, precision, **over):
    cfg = {"stage": "train", "engine": engine, "shards": shards, "data": os.path.join(work, "data"),
           "output": os.path.join(run, "output"), "scratch": os.path.join(run, "scratch"), "tp": 1, "pp": 1,
           "dp": 1, "iterations": 30, "seq_length": 256, "micro_batch_size": 2, "global_batch_size": 8,
           "lr": 3e-3, "min_lr": 3e-4, "warmup_iterations": 5, "lr_decay": "cosine", "weight_decay": 0.1,
           "adam_beta1": 0.9, "adam_beta2": 0.95, "clip_grad": 1.0, "seed": 1234, "precision": precision,
           "save_interval": 10, "log_interval": 1, "eval_interval": 10, "eval_iters": 2, "attention": "sdpa"}
    cfg.update(over)
    os.makedirs(run, exist_ok=True)
    path = os.path.join(run, "train.json")
    json.dump(cfg, open(path, "w"))
    return path


def launch(cfg_path, run, pythonpath=WORKLOADS, worker=False, env=None):
    e = dict(os.environ, MFLOW_METRICS=os.path.join(run, "metrics.jsonl"), MFLOW_STATUS=os.path.join(run, "status.json"),
             PYTHONPATH=pythonpath + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    cmd = [sys.executable] + ([os.path.abspath(__file__), worker] if worker else ["-m", "mflow_workloads.train"])
    t0 = time.time()
    p = subprocess.run(cmd + [cfg_path], env=e, capture_output=True, text=True, timeout=240)
    with open(os.path.join(run, "log.txt"), "w") as f:
        f.write(p.stdout + p.stderr)
    if p.returncode != 0:
        print(p.stderr[-3000:], flush=True)
    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))] if os.path.exists(
        os.path.join(run, "metrics.jsonl")) else []
    return {"rc": p.returncode, "wall_s": round(time.time() - t0, 1),
            "train": [x for x in lines if "loss" in x], "val": [x for x in lines if "val_loss" in x]}


def reference_samples(cfg, meta, dp):
    """The reference engine's windows as GPTDataset items (for check 3)."""
    import torch
    from mflow_workloads import data as D

    class Items:
        def __init__(self, split, shuffle):
            self.src = D.SampleSource(os.path.join(cfg.data, split), cfg.seq_length, cfg.seed, shuffle)

        def __getitem__(self, k):
            w = torch.from_numpy(self.src.sample(k))
            n = cfg.seq_length
            return {"tokens": w[:-1], "labels": w[1:], "loss_mask": torch.ones(n), "position_ids": torch.arange(n)}

    return Items("train", True), Items("valid", False)


def worker(cfg_path):
    from mflow_workloads import runtime
    from mflow_workloads.config import load_train
    from mflow_workloads.megatron import batches as MB, trainer as MT

    MB.build_datasets = reference_samples
    sys.exit(runtime.run_main(lambda p: MT.run(load_train(p)), cfg_path))


def reference_worker(cfg_path):
    """The reference engine on this GPU. Its loop all-reduces CPU flags, which NCCL alone cannot
    carry: a group of one with gloo for CPU and NCCL for CUDA tensors, made before the entry point
    (which then keeps it)."""
    import datetime
    import torch
    import torch.distributed as dist
    from mflow_workloads import runtime, train

    torch.cuda.set_device(0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 2000))
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=300))
    sys.exit(runtime.run_main(train.main, cfg_path))


def main():
    work, out = sys.argv[1:3]
    import torch
    import fixtures_lib as FL

    os.makedirs(work, exist_ok=True)
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    tok = FL.make_tokenizer(os.path.join(work, "tok"))
    FL.make_dataset(os.path.join(work, "data"), tok)
    shards = {}
    for tied in (False, True):
        hf = os.path.join(work, f"hf_tied{int(tied)}")
        with torch.device("cuda"):
            FL.make_hf_model(hf, tok, tied=tied, **MODEL)
        for dtype in ("float32", "bfloat16"):
            shards[tied, dtype] = FL.convert_hf_to_shards(hf, os.path.join(work, f"sh_tied{int(tied)}_{dtype}"), 1, dtype)
    print(f"prepared in {time.time() - t0:.1f}s", flush=True)
    results, ok = {}, True

    def report(name, res, passed):
        nonlocal ok
        ok &= bool(passed)
        res["passed"] = bool(passed)
        results[name] = res
        print(name.upper(), json.dumps(res), flush=True)

    # 1. unchanged at tp = pp = dp = 1 (bf16, 4 micro-batches per step).
    sh = shards[False, "bfloat16"]
    now_run = os.path.join(work, "now")
    now = launch(config(work, now_run, sh, "megatron", "bf16"), now_run)
    before_py = os.path.join(ROOT, ".before")
    res = {"now_rc": now["rc"], "now_wall_s": now["wall_s"],
           "losses_now": [round(x["loss"], 6) for x in now["train"]],
           "val_now": [x["val_loss"] for x in now["val"]],
           "tokens_per_s_median": sorted(x["tokens_per_s"] for x in now["train"])[len(now["train"]) // 2] if now["train"] else None,
           "tflops_per_gpu_median": sorted(x["tflops_per_gpu"] for x in now["train"])[len(now["train"]) // 2] if now["train"] else None,
           "mem_gib": now["train"][-1]["mem_gib"] if now["train"] else None}
    if os.path.isdir(os.path.join(before_py, "mflow_workloads")):
        before_run = os.path.join(work, "before")
        before = launch(config(work, before_run, sh, "megatron", "bf16"), before_run, pythonpath=before_py)
        nmb = int(os.environ.get("BEFORE_LOSS_SCALE", "1"))
        res.update(before_rc=before["rc"], before_wall_s=before["wall_s"],
                   losses_before=[round(x["loss"], 6) for x in before["train"]],
                   max_abs_loss_diff=max((abs(a["loss"] - nmb * b["loss"]) for a, b in zip(now["train"], before["train"])), default=None),
                   max_abs_grad_norm_diff=max((abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(now["train"], before["train"])), default=None),
                   identical=len(now["train"]) == len(before["train"])
                   and all(a["grad_norm"] == b["grad_norm"] and a["loss"] == nmb * b["loss"] for a, b in zip(now["train"], before["train"]))
                   and [x["val_loss"] for x in now["val"]] == [nmb * x["val_loss"] for x in before["val"]])
        passed = now["rc"] == 0 and before["rc"] == 0 and len(now["train"]) == 30 and res["identical"]
    else:
        res["before"] = "not run (.before/mflow_workloads absent)"
        passed = now["rc"] == 0 and len(now["train"]) == 30
    report("unchanged", res, passed)

    # 2. resume from the checkpoint at 20 and redo 21..30.
    ck = os.path.join(now_run, "scratch", "checkpoints")
    shutil.rmtree(os.path.join(ck, "iter_0000030"), ignore_errors=True)
    with open(os.path.join(ck, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("20")
    shutil.rmtree(os.path.join(now_run, "output"), ignore_errors=True)
    os.replace(os.path.join(now_run, "metrics.jsonl"), os.path.join(now_run, "metrics_first.jsonl"))
    again = launch(os.path.join(now_run, "train.json"), now_run)
    first = {x["iteration"]: x["loss"] for x in now["train"]}
    redo = {x["iteration"]: x["loss"] for x in again["train"]}
    diff = max((abs(redo[i] - first[i]) for i in redo if i in first), default=None)
    log = open(os.path.join(now_run, "log.txt")).read()
    report("resume", {"rc": again["rc"], "wall_s": again["wall_s"], "iterations": sorted(redo),
                      "resumed_line": "resumed from checkpoint at iteration 20" in log,
                      "max_abs_loss_diff_21_30": diff},
           again["rc"] == 0 and sorted(redo) == list(range(21, 31)) and diff is not None and diff <= 1e-5)

    # 3. against the reference engine on the same samples, fp32.
    for tied in (False, True):
        sh = shards[tied, "float32"]
        over = dict(iterations=5, eval_interval=5, save_interval=5)
        mr, rr = os.path.join(work, f"par_meg_{int(tied)}"), os.path.join(work, f"par_ref_{int(tied)}")
        meg = launch(config(work, mr, sh, "megatron", "fp32", **over), mr, worker="--worker")
        ref = launch(config(work, rr, sh, "reference", "fp32", **over), rr, worker="--reference",
                     env={"MFLOW_REFERENCE_DEVICE": "cuda"})
        d = [abs(a["loss"] - b["loss"]) for a, b in zip(meg["train"], ref["train"])]
        g = [abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(meg["train"], ref["train"])]
        v = [abs(a["val_loss"] - b["val_loss"]) for a, b in zip(meg["val"], ref["val"])]
        report(f"reference_{'tied' if tied else 'untied'}", {
            "megatron_rc": meg["rc"], "reference_rc": ref["rc"], "wall_s": [meg["wall_s"], ref["wall_s"]],
            "loss_megatron": [x["loss"] for x in meg["train"]], "loss_reference": [x["loss"] for x in ref["train"]],
            "abs_loss_diff": d, "abs_grad_norm_diff": g, "abs_val_loss_diff_after_5": v},
            meg["rc"] == 0 and ref["rc"] == 0 and len(d) == 5 and d[0] <= 1e-5 and max(d) <= 1e-3)

    results["total_s"] = round(time.time() - t0, 1)
    json.dump(results, open(os.path.join(out, "megatron_pp.json"), "w"), indent=1)
    print("ALL", "passed" if ok else "FAILED", f"in {results['total_s']}s", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(sys.argv[2])
    elif sys.argv[1] == "--reference":
        reference_worker(sys.argv[2])
    else:
        main()
