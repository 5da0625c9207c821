"""Training throughput of the Megatron engine on the Llama-3.2-1B shape, seq 4096, micro-batch 4, bf16,
one variant after another in one process (baseline first: the GPU probe's configuration).

python -m torch.distributed.run --nproc-per-node=TP tests/gpu/bench_train.py SHARDS OUT.jsonl [variants]
A variant is '+'-joined knobs: base, default (the engine's default knobs), the engine's knobs (fused_adam, swiglu_fusion, ce_fusion, ce_compiled,
wgrad_fusion, foreach_optim, swiglu_backward, cudnn_attn, cudnn_attn_expand, compile_rope, compile_norm, seq_parallel), mbsN
(micro-batch N instead of 4), accN (N micro-batches per step, gradient accumulation; one by default) and
prof (profile this variant). BENCH_PROFILE=1 profiles two steps of every variant after the timed ones and
prints where the GPU time goes.
"""

import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "workloads"))

from mflow_workloads.megatron import batches as MB, model as MM, trainer as MT  # noqa: E402
from mflow_workloads import shards as S  # noqa: E402
from mflow_workloads.flops import flops_per_batch  # noqa: E402

SEQ, MBS, STEPS, WARMUP = 4096, 4, 10, 3


def run_variant(ps, shards, knobs):
    mbs = next((int(k[3:]) for k in knobs if k.startswith("mbs")), MBS)
    acc = next((int(k[3:]) for k in knobs if k.startswith("acc")), 1)
    shape = {k for k in knobs if k.startswith(("mbs", "acc"))}
    prof = "prof" in knobs or os.environ.get("BENCH_PROFILE") == "1"
    knobs = knobs - shape - {"prof"}
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    tp = ps.get_tensor_model_parallel_world_size()
    m = S.read_manifest(shards)
    spec = S.spec_of(m)
    MT.set_process_knobs(knobs)
    config = MM.transformer_config(spec, tp, 1, "bf16", knobs)
    model = MM.build_model(spec, config, tp, SEQ, "sdpa", knobs)
    MM.load_shard(model, shards, m, ps.get_tensor_model_parallel_rank(), 0)
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32="bf16_grads" not in knobs, overlap_grad_reduce=False, use_distributed_optimizer=False), module=model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, params_dtype=torch.bfloat16,
                                                 use_distributed_optimizer=False, clip_grad=1.0), [ddp])
    config.no_sync_func, config.finalize_model_grads_func, config.grad_scale_func = ddp.no_sync, finalize_model_grads, opt.scale_loss
    fb = get_forward_backward_func()
    g = torch.Generator(device="cuda").manual_seed(0)

    def data():
        while True:
            t = torch.randint(0, 500, (mbs, SEQ + 1), device="cuda", generator=g)
            yield {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(mbs, SEQ, device="cuda"),
                   "position_ids": torch.arange(SEQ, device="cuda").unsqueeze(0).expand(mbs, -1)}

    it = data()
    mem_before = torch.cuda.memory_allocated() / 2**30
    times, losses = [], []
    torch.cuda.reset_peak_memory_stats()
    def step():
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = fb(forward_step_func=MB.forward_step, data_iterator=it, model=[ddp], num_microbatches=acc,
                 seq_length=SEQ, micro_batch_size=mbs, decoder_seq_length=SEQ, forward_only=False)
        opt.step()
        return out

    for i in range(STEPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(out[0]["lm loss"]))
    if prof:
        profile(step)
    dt = statistics.median(times[WARMUP:])
    world = dist.get_world_size()
    tokens = mbs * acc * SEQ * (world // tp)
    f019 = flops_per_batch(spec, mbs * acc * (world // tp), SEQ, spec.padded_vocab_for(tp))
    n_local = sum(p.numel() for p in model.parameters())
    n_untied = n_local * tp + (spec.padded_vocab_for(tp) * spec.hidden_size if spec.share_embeddings_and_output_weights else 0)
    f_probe = (6 * n_untied + 12 * spec.num_layers * spec.hidden_size * SEQ) * tokens
    res = {"variant": "+".join(sorted(knobs) + sorted(shape)) or "base", "tp": tp, "gpus": world, "step_s": round(dt, 4),
           "step_s_spread": round(max(times[WARMUP:]) - min(times[WARMUP:]), 4),
           "tokens_per_s": round(tokens / dt), "tflops_per_gpu_mcore019": round(f019 / dt / 1e12 / world, 1),
           "tflops_per_gpu_probe_formula": round(f_probe / dt / 1e12 / world, 1),
           "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1), "mem_at_start_gib": round(mem_before, 1),
           "first_step_s": round(times[0], 2), "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4)}
    del ddp, opt, model, fb, step, out
    gc.collect()  # Megatron's DDP hooks hold the model in reference cycles
    torch.cuda.empty_cache()
    return res


def profile(step, steps=2):
    """Share of GPU kernel time per kind, and the top kernels, over `steps` steps (rank 0 prints)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    if dist.get_rank() != 0:
        return
    kinds = {"gemm": ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas"), "nccl": ("nccl",),
             "attention": ("flash", "fmha", "cudnn", "attn")}
    totals, rows = {}, []
    for e in prof.key_averages():
        us = e.device_time_total
        if us <= 0:
            continue
        name = e.key.lower()
        kind = next((k for k, pats in kinds.items() if any(p in name for p in pats)), "other")
        totals[kind] = totals.get(kind, 0) + us
        rows.append((us, e.count, kind, e.key[:110]))
    busy = sum(totals.values())
    print(f"PROFILE step {wall * 1e3:.1f} ms (under the profiler), kernel time {busy / steps / 1e3:.1f} ms per step: "
          + ", ".join(f"{k} {v / busy:.1%}" for k, v in sorted(totals.items(), key=lambda kv: -kv[1])), flush=True)
    for us, n, kind, name in sorted(rows, reverse=True)[:35]:
        print(f"PROFILE {us / steps / 1e3:8.2f} ms/step {n // steps:5d}x {kind:9s} {name}", flush=True)


def main():
    shards, out = sys.argv[1], sys.argv[2]
    variants = sys.argv[3].split(",") if len(sys.argv) > 3 else ["base", "ce_fusion", "swiglu_fusion", "fused_adam",
                                                                 "ce_fusion+fused_adam+swiglu_fusion"]
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    ps.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    model_parallel_cuda_manual_seed(1234)
    for v in variants:
        knobs = {k for k in v.split("+") if k not in ("base", "default")}
        if "default" in v.split("+"):
            knobs |= set(MT.DEFAULT_KNOBS.split(","))
        try:
            r = run_variant(ps, shards, knobs)
        except Exception as e:  # noqa: BLE001 - record the failure, go on
            r = {"variant": v, "error": f"{type(e).__name__}: {str(e)[:400]}"}
        gc.collect()  # after the handler, whose traceback held the failed variant's tensors
        torch.cuda.empty_cache()
        if dist.get_rank() == 0:
            print("BENCH", json.dumps(r), flush=True)
            with open(out, "a") as f:
                f.write(json.dumps(r) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
