"""Llama-3.2-1B shape through `mflow_workloads.train` (Megatron, TP=2, seq 4096): timings of a run with
checkpoints, then a second launch with more iterations that resumes from the last checkpoint.

python tests/gpu/train_big.py WORKDIR OUTDIR
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_resume import config, launch  # noqa: E402


def main():
    work, out = sys.argv[1:3]
    run = os.path.join(work, "big")
    os.makedirs(run, exist_ok=True)
    results = {}
    plan = [int(x) for x in os.environ.get("BIG_ITERS", "8,10").split(",")]
    for attempt, iters in (("first", plan[0]), ("resume", plan[1])):
        cfg = config(work, run, "megatron", os.path.join(work, "sh_llama_1b_tp2_bfloat16"), iters, 4096, "bf16")
        cfg.update(micro_batch_size=4, global_batch_size=4, save_interval=4, eval_interval=8, eval_iters=1,
                   lr=3e-4, min_lr=3e-5, warmup_iterations=2)
        if attempt == "resume":
            import shutil
            shutil.rmtree(cfg["output"], ignore_errors=True)
        path = os.path.join(run, f"train_{attempt}.json")
        json.dump(cfg, open(path, "w"))
        rc = launch(path, run, 29801 if attempt == "first" else 29802).wait()
        summary = json.load(open(os.path.join(cfg["output"], "train_summary.json"))) if rc == 0 else {}
        # The attempt's own figures (times, where it resumed) are the newest line of its metrics.
        attempt_lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
        summary.update(next((x for x in reversed(attempt_lines) if "train_time_s" in x), {}))
        results[attempt] = {"rc": rc, "summary": summary}
    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    results["metrics"] = lines
    steady = [x for x in lines if "tflops_per_gpu" in x and x["iteration"] not in (1, plan[0] + 1)]
    results["median_tflops_per_gpu"] = sorted(x["tflops_per_gpu"] for x in steady)[len(steady) // 2] if steady else None
    print("BIG", json.dumps({k: v for k, v in results.items() if k != "metrics"}), flush=True)
    json.dump(results, open(os.path.join(out, "train_big.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
