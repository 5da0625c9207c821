"""The Megatron engine's speed pieces (megatron/fusions.py) on CPU: its own cross-entropy (on CUDA its
kernels are compiled, on CPU the same functions run eagerly) against torch's cross_entropy; the
foreach optimizer ops against plain torch and Megatron's fallbacks; the SwiGLU backward kernel
through Triton's interpreter against Megatron's formula."""

import os

import pytest
import torch
import torch.nn.functional as F

from conftest import WORKLOADS
from mflow_workloads.megatron import fusions as MF


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_matches_torch(dtype):
    torch.manual_seed(0)
    s, b, v = 7, 3, 50
    logits = (torch.randn(s, b, v) * 3).to(dtype)
    target = torch.randint(0, v, (s, b))
    target[0, 0], target[1, 0] = 0, v - 1  # both ends of the vocabulary
    weight = torch.rand(s, b)
    x = logits.clone().requires_grad_(True)
    loss = MF.cross_entropy(x, target)
    (loss * weight).sum().backward()
    ref_in = logits.float().requires_grad_(True)
    ref = F.cross_entropy(ref_in.reshape(-1, v), target.reshape(-1), reduction="none").reshape(s, b)
    (ref * weight).sum().backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == dtype
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(x.grad.float(), ref_in.grad, rtol=tol, atol=tol)


def test_model_loss_takes_batch_major_labels():
    torch.manual_seed(1)
    s, b, v = 5, 2, 11
    logits = torch.randn(s, b, v)
    labels = torch.randint(0, v, (b, s))
    model = torch.nn.Module()
    MF.use_compiled_cross_entropy(model, None)
    got = model.compute_language_model_loss(labels, logits)
    want = F.cross_entropy(logits.permute(1, 2, 0), labels, reduction="none")
    assert got.shape == (b, s)
    torch.testing.assert_close(got, want)


def _tp_worker(rank, world, port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(2)
        s, b, v = 6, 2, 40
        logits = torch.randn(s, b, v) * 3
        target = torch.randint(0, v, (s, b))
        part = v // world
        x = logits[:, :, rank * part : (rank + 1) * part].clone().requires_grad_(True)
        loss = MF.cross_entropy(x, target, dist.group.WORLD)
        loss.sum().backward()
        ref_in = logits.clone().requires_grad_(True)
        ref = F.cross_entropy(ref_in.reshape(-1, v), target.reshape(-1), reduction="none").reshape(s, b)
        ref.sum().backward()
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, ref_in.grad[:, :, rank * part : (rank + 1) * part], rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


def test_cross_entropy_over_vocab_shards_matches_the_whole():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_tp_worker, args=(2, port), nprocs=2, join=True)


def _grads():
    torch.manual_seed(3)
    return [torch.randn(s) * 1e-2 for s in ((50, 16), (16,), (48, 16), (16, 64), (1,))]


def test_foreach_norm_is_the_norm_of_all():
    grads = _grads()
    norm, per_tensor = MF._l2_norm(2048 * 32, None, [grads], False)
    exact = torch.cat([t.double().flatten() for t in grads]).norm()
    assert norm.shape == (1,) and norm.dtype == torch.float32 and per_tensor is None
    assert abs(float(norm) - float(exact)) <= 1e-6 * float(exact)


def test_foreach_scale_is_megatrons_elementwise():
    main = _grads()
    model = [torch.empty(t.shape, dtype=torch.bfloat16) for t in main]
    MF._scale(0, None, [main, model], 1.0)  # main -> model weights: a rounding copy
    assert all(torch.equal(m, t.to(torch.bfloat16)) for m, t in zip(model, main, strict=True))
    clipped = [t.clone() for t in main]
    MF._scale(0, None, [clipped, clipped], 0.37)  # clipping in place
    assert all(torch.equal(c, t * 0.37) for c, t in zip(clipped, main, strict=True))
    out = [torch.empty_like(t) for t in main]
    MF._scale(0, None, [main, out], 2.5)
    assert all(torch.equal(o, t * 2.5) for o, t in zip(out, main, strict=True))


def test_foreach_optimizer_patches_and_restores_megatron():
    clip_grads = pytest.importorskip("megatron.core.optimizer.clip_grads")
    from megatron.core.optimizer import optimizer

    before = clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, optimizer.multi_tensor_scale_impl
    try:
        MF.enable_foreach_optimizer(True)
        assert clip_grads.l2_norm_impl is MF._l2_norm
        assert clip_grads.multi_tensor_scale_impl is MF._scale and optimizer.multi_tensor_scale_impl is MF._scale
        MF.enable_foreach_optimizer(True)  # twice: the originals are still Megatron's
    finally:
        MF.enable_foreach_optimizer(False)
    assert (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, optimizer.multi_tensor_scale_impl) == before


_SWIGLU_SCRIPT = """
import torch
from mflow_workloads.megatron import fusions as MF
torch.manual_seed(4)
rows, n = 6, 1500  # n not a multiple of the block: the masked tail
for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
    x = (torch.randn(rows, 2 * n) * 3).to(dtype)
    g = torch.randn(rows, n).to(dtype)
    got = MF.swiglu_backward(g, x)
    a, b = x.float().chunk(2, -1)
    gf, s = g.float(), torch.sigmoid(a)
    want = torch.cat((gf * s * (1 + a * (1 - s)) * b, gf * (a * s)), -1)
    assert got.shape == x.shape and got.dtype == dtype
    # The interpreter rounds to bf16 by truncation (the GPU to nearest): one bf16 step apart at most.
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
print("ok")
"""


def test_swiglu_backward_kernel_in_triton_interpreter():
    import subprocess
    import sys

    pytest.importorskip("triton")
    path = WORKLOADS + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    r = subprocess.run([sys.executable, "-c", _SWIGLU_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == "ok"


def test_process_knobs_are_undone():
    layers = pytest.importorskip("megatron.core.tensor_parallel.layers")
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import mlp

    from mflow_workloads.megatron import model as MM, trainer as MT

    def state():
        return (
            torch.optim.AdamW,
            getattr(layers, "fused_weight_gradient_mlp_cuda", None),
            layers._grad_accum_fusion_available,
            mlp.bias_swiglu_impl,
            rope_utils._apply_rotary_pos_emb_bshd,
        )

    before = state()
    try:
        MT.set_process_knobs({"fused_adam", "wgrad_fusion", "foreach_optim", "swiglu_backward"})
        MM._compile_rope(True)
        on = state()
        assert on[0] is not before[0] and on[0](torch.nn.Linear(2, 2).parameters()).defaults["fused"]
        assert on[1] is MF._WgradAccumulate and on[2] is True
        assert on[3] is not before[3] and on[4] is not before[4]
        MM._compile_rope(True)  # twice: compiled once, from Megatron's
        assert rope_utils._apply_rotary_pos_emb_bshd is on[4]
    finally:
        MT.set_process_knobs(set())
        MM._compile_rope(False)
    assert state() == before
