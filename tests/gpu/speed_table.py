"""The table speed_tp1.sh prints last: bench variants (bench.jsonl) and `mflow run` runs (runs/*.metrics.jsonl).

python tests/gpu/speed_table.py OUT_DIR
"""

import glob
import json
import os
import statistics
import sys


def runs(out):
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "runs", "*.metrics.jsonl"))):
        name = os.path.basename(path)[: -len(".metrics.jsonl")]
        lines = [json.loads(x) for x in open(path) if x.strip()]
        steps = [x for x in lines if "tflops_per_gpu" in x]
        vals = [x for x in lines if "val_loss" in x]
        timed = [x for x in steps if x["iteration"] >= 3]
        if not timed:
            rows.append(f"| run {name} | no iterations logged | | | | |")
            continue
        loss = {x["iteration"]: x["loss"] for x in steps}
        last = max(loss)
        val = f"val {vals[0]['val_loss']:.4f} -> {vals[-1]['val_loss']:.4f}" if vals else "no validation"
        rows.append(f"| run {name} | {statistics.median(x['tflops_per_gpu'] for x in timed):.1f} | "
                    f"{statistics.median(x['tokens_per_s'] for x in timed):,.0f} | "
                    f"{max(x['mem_gib'] for x in steps):.1f} | loss it1 {loss.get(1, float('nan')):.5f}, "
                    f"it{last} {loss[last]:.5f} | {val} |")
    return rows


def bench(out):
    rows = []
    path = os.path.join(out, "bench.jsonl")
    for r in (json.loads(x) for x in open(path)) if os.path.exists(path) else ():
        if "error" in r:
            rows.append(f"| bench {r['variant']} | error: {r['error'][:150]} | | | | |")
            continue
        rows.append(f"| bench {r['variant']} | {r['tflops_per_gpu_mcore019']} | {r['tokens_per_s']:,} | "
                    f"{r['peak_mem_gib']} | loss first {r['loss_first']}, last {r['loss_last']} | "
                    f"step {r['step_s']} s (spread {r['step_s_spread']}) |")
    return rows


def main():
    out = sys.argv[1]
    print("| what | TFLOP/s per GPU (MCore 0.19) | tokens/s | peak GiB | losses | other |")
    print("|---|---|---|---|---|---|")
    for row in bench(out) + runs(out):
        print(row)


if __name__ == "__main__":
    main()
