"""GPU check of the Megatron engine's fusions (mflow_workloads/megatron/fusions.py) against
references, with timings (one GPU, no process group).

python tests/gpu/check_fusions.py
- the weight-gradient accumulation (addmm into fp32) against float64, on fresh random data;
- the compiled cross-entropy against Megatron's native fused one and torch's cross_entropy in fp32:
  loss and logits gradient, Llama-3 vocab (128256), 4 x 4096 tokens; the time of forward + backward
  of each (CUDA events, median of 10 after 3 warm-ups). Prints CHECK lines and exits 1 on a miss.
"""

import os
import statistics
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "workloads"))

from mflow_workloads.megatron import fusions as MF  # noqa: E402


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def timed(fn, reps=10, warmup=3):
    times = []
    for i in range(reps + warmup):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(s.elapsed_time(e))
    return statistics.median(times)


def check_wgrad(ok):
    for n, k, m in ((16384, 2048, 3072), (32768, 8192, 2048)):
        x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(n, m, device="cuda", dtype=torch.bfloat16)
        acc = torch.randn(m, k, device="cuda", dtype=torch.float32)
        start = acc.clone()
        MF._WgradAccumulate.wgrad_gemm_accum_fp32(x, g, acc)
        err = rel(acc, start.double() + g.double().t() @ x.double())
        t_fused = timed(lambda: MF._WgradAccumulate.wgrad_gemm_accum_fp32(x, g, acc))
        t_plain = timed(lambda: acc.add_(g.t() @ x))
        good = err < 1e-4 and not torch.isnan(acc).any()
        ok &= good
        print(f"CHECK wgrad {n}x{k}->{m}: rel err {err:.2e} ({'ok' if good else 'MISS'}), "
              f"fused {t_fused:.3f} ms, bf16 GEMM + fp32 add {t_plain:.3f} ms", flush=True)
    return ok


def check_ce(ok):
    from megatron.core import parallel_state as ps
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    s, b, v = 4096, 4, 128256
    torch.manual_seed(0)
    logits = (torch.randn(s, b, v, device="cuda") * 2).to(torch.bfloat16)
    target = torch.randint(0, v, (s, b), device="cuda")
    gout = torch.rand(s, b, device="cuda")
    ref_in = logits.float().requires_grad_(True)
    ref = F.cross_entropy(ref_in.view(-1, v), target.view(-1), reduction="none").view(s, b)
    (ref * gout).sum().backward()
    group = ps.get_tensor_model_parallel_group()
    results = {}
    for name, fn in (("compiled", lambda x: MF.cross_entropy(x, target, group)),
                     ("megatron native", lambda x: fused_vocab_parallel_cross_entropy(x, target, group))):
        x = logits.clone().requires_grad_(True)
        loss = fn(x)
        (loss * gout).sum().backward()
        e_loss, e_grad = rel(loss, ref), rel(x.grad.float(), ref_in.grad)

        def step():
            y = logits.detach().requires_grad_(True)
            (fn(y) * gout).sum().backward()

        ms = timed(step)
        results[name] = ms
        good = e_loss < 1e-5 and e_grad < 1e-2
        ok &= good
        print(f"CHECK cross-entropy {name}: loss rel err {e_loss:.2e}, grad rel err {e_grad:.2e} "
              f"({'ok' if good else 'MISS'}), forward+backward {ms:.2f} ms", flush=True)
    print(f"CHECK cross-entropy speed-up {results['megatron native'] / results['compiled']:.2f}x", flush=True)
    return ok


def main():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    ps.initialize_model_parallel(1)
    ok = check_wgrad(True)
    ok = check_ce(ok)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
