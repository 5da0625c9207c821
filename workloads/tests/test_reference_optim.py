"""The reference engine's AdamW and its shared-memory all-reduce compute bit for bit what torch's
AdamW and gloo compute."""

import os
import subprocess
import sys

import torch

from conftest import HERE, torchrun
from mflow_workloads.reference.optim import AdamW


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in ((64, 48), (48,), (7, 3, 5), (1,))]


def test_adamw_matches_torch_bit_for_bit():
    ours, theirs = _params(0), _params(0)

    def groups(ps):
        return [
            {"params": [p for p in ps if p.ndim > 1], "weight_decay": 0.1},
            {"params": [p for p in ps if p.ndim <= 1], "weight_decay": 0.0},
        ]

    a = AdamW(groups(ours), lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    b = torch.optim.AdamW(groups(theirs), lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(1)
    for step in range(25):
        lr = 3e-3 * (0.5 + 0.5 * (step % 7) / 7)  # the trainer sets the lr of every group each step
        for opt in (a, b):
            for group in opt.param_groups:
                group["lr"] = lr
        for x, y in zip(ours, theirs, strict=True):
            grad = torch.randn(x.shape, generator=g) * (10.0 ** (step % 5 - 3))
            x.grad, y.grad = grad.clone(), grad.clone()
        if step == 3:
            ours[1].grad = theirs[1].grad = None  # a parameter without a gradient keeps its state
        a.step()
        b.step()
        a.zero_grad(set_to_none=True)
        b.zero_grad(set_to_none=True)
        for x, y in zip(ours, theirs, strict=True):
            assert torch.equal(x, y), step
            assert x.grad is None
    for x, y in zip(ours, theirs, strict=True):
        sa, sb = a.state[x], b.state[y]
        assert sa.keys() == sb.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def test_shared_memory_all_reduce_matches_gloo():
    proc = torchrun(2, [os.path.join(HERE, "shm_worker.py")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT ok" in proc.stdout, proc.stdout[-2000:]


def test_a_lost_peer_is_an_infra_error():
    proc = torchrun(2, [os.path.join(HERE, "shm_worker.py"), "peer-lost"])
    assert "RESULT peer-lost" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_optimizer_does_not_import_dynamo():
    code = (
        "import sys, torch; from mflow_workloads.reference.optim import AdamW; "
        "p = torch.nn.Parameter(torch.ones(3)); o = AdamW([{'params': [p], 'weight_decay': 0.1}], lr=1e-3, "
        "betas=(0.9, 0.95), eps=1e-8); p.grad = torch.ones(3); o.step(); "
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'"
    )
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
