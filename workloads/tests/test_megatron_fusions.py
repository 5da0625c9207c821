"""The Megatron engine's own cross-entropy (megatron/fusions.py; on CUDA its kernels are compiled, on
CPU the same functions run eagerly): the loss and logits gradient of torch's cross_entropy."""

import pytest
import torch
import torch.nn.functional as F

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
