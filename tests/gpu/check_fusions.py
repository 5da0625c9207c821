"""GPU check of the Megatron engine's fusions (mflow_workloads/megatron/fusions.py) against
references, with timings (one GPU, no process group).

python tests/gpu/check_fusions.py            # CHECKS=swiglu,foreach for some of them
- the weight-gradient accumulation (addmm into fp32) against float64, on fresh random data;
- the compiled cross-entropy against Megatron's native fused one and torch's cross_entropy in fp32:
  loss and logits gradient, Llama-3 vocab (128256), 4 x 4096 tokens; the time of forward + backward
  of each (CUDA events, median of 10 after 3 warm-ups);
- SwiGLU's backward kernel against Megatron's compiled swiglu_back (bitwise, and float64), MLP-sized;
- the foreach optimizer ops against Megatron's local fallbacks: the gradient norm, clipping and
  the main -> model weight copy on the Llama-3.2-1B shapes, and their time.
Prints CHECK lines and exits 1 on a miss.
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


def check_swiglu(ok):
    from megatron.core.fusions.fused_bias_swiglu import swiglu_back

    torch.manual_seed(0)
    rows, n = 4 * 4096, 8192
    x = torch.randn(rows, 2 * n, device="cuda", dtype=torch.bfloat16) * 3
    g = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    ours, megatrons = MF.swiglu_backward(g, x), swiglu_back(g, x)
    a, b = x.double().chunk(2, -1)
    s = torch.sigmoid(a)
    exact = torch.cat((g.double() * s * (1 + a * (1 - s)) * b, g.double() * a * s), -1)
    same = float((ours == megatrons).float().mean())
    e_ours, e_meg = rel(ours, exact), rel(megatrons, exact)
    t_ours = timed(lambda: MF.swiglu_backward(g, x))
    t_meg = timed(lambda: swiglu_back(g, x))
    gb = (x.numel() * 2 * 2 + g.numel() * 2) / 1e9
    good = e_ours <= e_meg * 1.01 + 1e-6 and same > 0.99
    ok &= good
    print(f"CHECK swiglu backward {rows}x{2 * n}: bitwise equal to Megatron's {same:.4%}, rel err ours {e_ours:.2e} "
          f"Megatron's {e_meg:.2e} ({'ok' if good else 'MISS'}); ours {t_ours:.3f} ms ({gb / t_ours:.2f} TB/s), "
          f"Megatron's {t_meg:.3f} ms ({gb / t_meg:.2f} TB/s)", flush=True)
    return ok


def check_foreach_optimizer(ok):
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    torch.manual_seed(0)
    h, ffn, layers, vocab = 2048, 8192, 16, 128256
    shapes = [(vocab, h)] + [(3072, h), (h, h), (2 * ffn, h), (h, ffn), (h,), (h,)] * layers + [(h,)]
    grads = [torch.randn(s, device="cuda") * 1e-3 for s in shapes]
    norm_ours, _ = MF._l2_norm(0, None, [grads], False)
    norm_meg, _ = local_multi_tensor_l2_norm(0, None, [grads], False)
    exact = torch.stack([t.double().norm() for t in grads]).norm()
    e_norm = abs(float(norm_ours) - float(exact)) / float(exact)
    main = [torch.randn(s, device="cuda") for s in shapes]
    model_ours = [torch.empty(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
    model_meg = [torch.empty(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
    MF._scale(0, None, [main, model_ours], 1.0)
    local_multi_tensor_scale(0, None, [main, model_meg], 1.0)
    copy_same = all(torch.equal(a, b) for a, b in zip(model_ours, model_meg))
    clip_ours, clip_meg = [t.clone() for t in grads], [t.clone() for t in grads]
    MF._scale(0, None, [clip_ours, clip_ours], 0.37)
    local_multi_tensor_scale(0, None, [clip_meg, clip_meg], 0.37)
    clip_same = all(torch.equal(a, b) for a, b in zip(clip_ours, clip_meg))
    times = {
        "norm ours": timed(lambda: float(MF._l2_norm(0, None, [grads], False)[0])),
        "norm Megatron's": timed(lambda: float(local_multi_tensor_l2_norm(0, None, [grads], False)[0])),
        "copy ours": timed(lambda: MF._scale(0, None, [main, model_ours], 1.0)),
        "copy Megatron's": timed(lambda: local_multi_tensor_scale(0, None, [main, model_meg], 1.0)),
        "clip ours": timed(lambda: MF._scale(0, None, [clip_ours, clip_ours], 0.999)),
        "clip Megatron's": timed(lambda: local_multi_tensor_scale(0, None, [clip_meg, clip_meg], 0.999)),
    }
    good = e_norm < 1e-5 and copy_same and clip_same
    ok &= good
    print(f"CHECK foreach optimizer: norm rel err {e_norm:.2e} (Megatron's "
          f"{abs(float(norm_meg) - float(exact)) / float(exact):.2e}), copy bitwise equal {copy_same}, clip bitwise "
          f"equal {clip_same} ({'ok' if good else 'MISS'}); "
          + ", ".join(f"{k} {v:.2f} ms" for k, v in times.items()), flush=True)
    return ok


def main():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    ps.initialize_model_parallel(1)
    checks = {"wgrad": check_wgrad, "ce": check_ce, "swiglu": check_swiglu, "foreach": check_foreach_optimizer}
    ok = True
    for name in os.environ.get("CHECKS", ",".join(checks)).split(","):
        ok = checks[name](ok)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
