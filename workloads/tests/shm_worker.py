"""Compares the shared-memory tp all-reduce with gloo's on the same tensors (run by torchrun, 2 ranks)."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mflow_workloads.reference import parallel as RP, shm


def peer_lost(p, rank):
    """Rank 1 leaves without a word; rank 0's next all-reduce fails as an infra error."""
    if rank == 1:
        os._exit(0)
    import time

    t = time.monotonic()
    try:
        RP.tp_all_reduce(torch.ones(4), p)
    except shm.PeerLost as e:
        assert e.cls == "infra" and "exited" in str(e), e
        print(f"RESULT peer-lost after {time.monotonic() - t:.1f} s", flush=True)
        os._exit(0)
    raise AssertionError("the all-reduce returned without a peer")


def main():
    dist.init_process_group("gloo")
    p = RP.setup(2, 1)
    assert p.tp_shm is not None, "the shared-memory channel was not set up"
    rank = dist.get_rank()
    if sys.argv[1:] == ["peer-lost"]:
        peer_lost(p, rank)
    g = torch.Generator().manual_seed(100 + rank)
    cases = [
        ((8, 128, 256), torch.float32),
        ((3, 5), torch.float32),
        ((), torch.float64),
        ((2, 8, 128), torch.float32),
        ((shm.SLOT_BYTES // 4 + 1,), torch.float32),
    ]  # the last is larger than a slot: gloo
    for round_ in range(3):  # alternate slots more than once
        for shape, dtype in cases:
            x = torch.randn(shape, generator=g, dtype=dtype) * 10.0 ** (round_ - 1)
            if x.numel() > 4:
                x.view(-1)[:4] = torch.tensor([0.0, -0.0, 1e-38, -3.0], dtype=dtype)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
                ref = x.clone()
                dist.all_reduce(ref, op=op, group=p.tp_group)
                before = x.clone()
                got = RP.tp_all_reduce(x, p, op)
                assert torch.equal(x, before), "the input must be left as it was"
                assert got.shape == x.shape and got.dtype == x.dtype
                # bit for bit, signed zeros included
                assert torch.equal(got.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)), (
                    shape,
                    dtype,
                    op,
                )
    # A non-contiguous input is reduced as its contiguous copy would be.
    y = torch.randn(16, 12, generator=g).t()
    ref = y.contiguous()
    dist.all_reduce(ref, group=p.tp_group)
    assert torch.equal(RP.tp_all_reduce(y, p), ref)
    if rank == 0:
        print("RESULT ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
