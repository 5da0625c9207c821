"""The Megatron engine's norm module (it replaces Megatron's torch norm wrapper, which refuses
sequence parallelism): same outputs, gradients and state-dict keys as torch's norms."""

import types

import pytest
import torch

from mflow_workloads.errors import ConfigError
from mflow_workloads.megatron import model as MM


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("sp", [False, True])
def test_norm_matches_torch(kind, sp):
    torch.manual_seed(0)
    cfg = types.SimpleNamespace(normalization=kind, sequence_parallel=sp)
    norm = MM._norm_class(set())(cfg, 32, eps=1e-6)
    ref = torch.nn.RMSNorm(32, eps=1e-6) if kind == "RMSNorm" else torch.nn.LayerNorm(32, eps=1e-6)
    with torch.no_grad():
        for p, q in zip(norm.parameters(), ref.parameters(), strict=True):
            p.copy_(torch.randn_like(p))
            q.copy_(p)
    assert sorted(norm.state_dict()) == sorted(ref.state_dict())
    x = torch.randn(5, 2, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    norm(x).square().sum().backward()
    ref(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    for p, q in zip(norm.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
        # Megatron sums the gradients of parameters marked this way over the TP group.
        assert p.sequence_parallel is sp


def test_unsupported_normalization_is_named():
    cfg = types.SimpleNamespace(normalization="L2Norm", sequence_parallel=False)
    with pytest.raises(ConfigError, match="L2Norm"):
        MM._norm_class(set())(cfg, 8)
