"""The compute floor of the CPU main job's training: one rank's matrix products, timed alone.

    python benches/main-job/floor.py SHARDS_DIR [--micro-batch 8] [--seq 128] [--micro-batches 2]
        [--iterations 300] [--eval-every 50] [--eval-iters 4]

SHARDS_DIR is the convert stage's output (its manifest gives the shape and tp). Each tensor-
parallel rank of the reference engine runs, per micro-batch, the forward product and the two
backward products (input and weight gradients) of every linear layer, and attention forward and
backward. They are timed here on one thread, the way a rank runs them (`OMP_NUM_THREADS` = cpus /
ranks), with nothing else: no norms, RoPE, activations, optimizer or communication. Times are
process CPU time, medians of rounds, so that a busy machine moves them less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F


def linears(m: dict, tp: int) -> list[tuple[int, int]]:
    """(in, out) of each linear layer of one rank, the output layer last."""
    h, kv = m["hidden_size"], m["kv_channels"]
    heads, groups = m["num_attention_heads"] // tp, m["num_query_groups"] // tp
    ffn = m["ffn_hidden_size"] // tp
    layer = [
        (h, (heads + 2 * groups) * kv),  # linear_qkv
        (heads * kv, h),  # linear_proj
        (h, ffn * (2 if m["gated_linear_unit"] else 1)),  # linear_fc1
        (ffn, h),  # linear_fc2
    ]
    vocab = m.get("padded_vocab_size") or m["vocab_size"]
    return layer * m["num_layers"] + [(h, vocab // tp)]


def timed(fn, rounds: int = 7) -> float:
    fn()
    samples = []
    for _ in range(rounds):
        t = time.process_time()
        fn()
        samples.append(time.process_time() - t)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shards")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-iters", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(1)
    with open(os.path.join(a.shards, "mflow-checkpoint.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    m, tp = manifest["model"], manifest["tp"]
    tokens = a.micro_batch * a.seq
    torch.manual_seed(0)

    fwd_flops = 0
    forward, backward = [], []
    for n_in, n_out in linears(m, tp):
        x, w, dy = torch.randn(tokens, n_in), torch.randn(n_out, n_in), torch.randn(tokens, n_out)
        forward.append(lambda x=x, w=w: F.linear(x, w))
        backward.append(lambda w=w, dy=dy: dy @ w)  # input gradient
        backward.append(lambda x=x, dy=dy: dy.t() @ x)  # weight gradient
        fwd_flops += 2 * tokens * n_in * n_out
    heads, kv = m["num_attention_heads"] // tp, m["kv_channels"]
    qkv = [torch.randn(a.micro_batch, heads, a.seq, kv, requires_grad=True) for _ in range(3)]
    scale = kv**-0.5

    def attention_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(*qkv, is_causal=True, scale=scale)

    def attention_fwd_bwd():
        F.scaled_dot_product_attention(*qkv, is_causal=True, scale=scale).sum().backward()

    linear_fwd = timed(lambda: [f() for f in forward])
    linear_bwd = timed(lambda: [f() for f in backward])
    attn_fwd = timed(attention_fwd) * m["num_layers"]
    attn_all = timed(attention_fwd_bwd) * m["num_layers"]

    step = (linear_fwd + linear_bwd + attn_all) * a.micro_batches
    evals = (a.iterations // a.eval_every) * a.eval_iters * (linear_fwd + attn_fwd)
    floor = step * a.iterations + evals
    rate = 3 * fwd_flops / (linear_fwd + linear_bwd) / 1e9
    report = {
        "tp": tp,
        "tokens_per_micro_batch": tokens,
        "linear_gflop_per_step": round(3 * fwd_flops * a.micro_batches / 1e9, 2),
        "linear_gflops_one_thread": round(rate, 1),
        "ms_per_step": {
            "linear_forward": round(linear_fwd * a.micro_batches * 1e3, 1),
            "linear_backward": round(linear_bwd * a.micro_batches * 1e3, 1),
            "attention": round(attn_all * a.micro_batches * 1e3, 1),
            "all": round(step * 1e3, 1),
        },
        "seconds_for_the_run": {"steps": round(step * a.iterations, 1), "validation": round(evals, 1)},
        "floor_s": round(floor, 1),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
