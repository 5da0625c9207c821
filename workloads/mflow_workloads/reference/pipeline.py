"""Pipeline schedules of the reference engine over torch.distributed point-to-point (gloo or NCCL).

Training runs Megatron's non-interleaved 1F1B schedule: stage s runs pp - s - 1 warm-up forwards,
then alternates one forward and one backward, then drains the remaining backwards. It computes
the same gradients as GPipe (all forwards, then all backwards) but holds at most pp - s
micro-batches of activations instead of all of them, and it is what the megatron engine runs, so
the two engines keep the same memory profile per stage.

Activations travel as float32 [micro_batch, seq, hidden] from a rank to the rank of the same
(tp, dp) coordinates on the next stage; their gradients travel back the same way. Every tp rank
sends its own (identical) copy, as Megatron does without its scatter-gather optimisation. A
paired send and receive are both posted before either is waited on, so neighbours that send to
each other at the same time cannot deadlock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from .parallel import Parallel

# (micro-batch index) -> (tokens on the first stage else None, labels on the last stage else None)
BatchFn = Callable[[int], tuple]


class P2P:
    def __init__(self, p: Parallel, shape: tuple[int, ...], device):
        self.p, self.shape, self.device = p, shape, device

    def _run(self, sends: list, recvs: list) -> None:
        works = [dist.isend(t.detach().float().contiguous(), dst) for t, dst in sends]
        works += [dist.irecv(buf, src) for buf, src in recvs]
        for w in works:
            w.wait()

    def _buf(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=torch.float32, device=self.device)

    def recv_forward(self) -> torch.Tensor | None:
        if self.p.is_first_stage:
            return None
        buf = self._buf()
        self._run([], [(buf, self.p.prev_rank)])
        return buf.requires_grad_()

    def send_forward(self, out: torch.Tensor) -> None:
        if not self.p.is_last_stage:
            self._run([(out, self.p.next_rank)], [])

    def recv_backward(self) -> torch.Tensor | None:
        if self.p.is_last_stage:
            return None
        buf = self._buf()
        self._run([], [(buf, self.p.next_rank)])
        return buf

    def send_backward(self, grad: torch.Tensor | None) -> None:
        if not self.p.is_first_stage:
            self._run([(grad, self.p.prev_rank)], [])

    def send_forward_recv_backward(self, out: torch.Tensor) -> torch.Tensor | None:
        if self.p.is_last_stage:
            return None
        buf = self._buf()
        self._run([(out, self.p.next_rank)], [(buf, self.p.next_rank)])
        return buf

    def send_backward_recv_forward(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        if self.p.is_first_stage:
            return None
        buf = self._buf()
        self._run([(grad, self.p.prev_rank)], [(buf, self.p.prev_rank)])
        return buf.requires_grad_()


def _autocast(device, dtype):
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def forward_backward(
    model, batch: BatchFn, num_mb: int, p: Parallel, shape: tuple[int, ...], device, autocast_dtype=None
) -> torch.Tensor:
    """One optimizer step's forwards and backwards (1F1B). Each micro-batch's mean token loss is
    divided by num_mb, as Megatron's schedule does, so gradients accumulate to the mean.
    Returns the sum of those scaled losses on the last stage (a float64 scalar), 0 elsewhere."""
    comm = P2P(p, shape, device)
    loss_sum = torch.zeros((), dtype=torch.float64)

    def forward(mb: int, inp):
        nonlocal loss_sum
        tokens, labels = batch(mb)
        with _autocast(device, autocast_dtype):
            if p.is_last_stage:
                out = model.loss(tokens, labels, hidden=inp).float().mean() / num_mb
                loss_sum += out.detach().double().cpu()
            else:
                out = model(tokens, hidden=inp)
        return out

    def backward(inp, out, grad):
        if grad is None:  # the last stage starts from its loss
            out.backward()
        else:
            torch.autograd.backward(out, grad_tensors=grad.to(out.dtype))
        return None if inp is None else inp.grad

    warmup = min(p.pp - p.pp_rank - 1, num_mb)
    steady = num_mb - warmup
    inflight: deque = deque()
    mb = 0
    for _ in range(warmup):
        inp = comm.recv_forward()
        out = forward(mb, inp)
        mb += 1
        comm.send_forward(out)
        inflight.append((inp, out))
    inp = comm.recv_forward() if steady > 0 else None
    for i in range(steady):
        out = forward(mb, inp)
        mb += 1
        grad_out = comm.send_forward_recv_backward(out)
        inflight.append((inp, out))
        old_inp, old_out = inflight.popleft()
        grad_in = backward(old_inp, old_out, grad_out)
        if i == steady - 1:
            inp = None
            comm.send_backward(grad_in)
        else:
            inp = comm.send_backward_recv_forward(grad_in)
    for _ in range(warmup):
        old_inp, old_out = inflight.popleft()
        grad_in = backward(old_inp, old_out, comm.recv_backward())
        comm.send_backward(grad_in)
    return loss_sum


@torch.no_grad()
def forward_only(
    model, batch: BatchFn, num_mb: int, p: Parallel, shape: tuple[int, ...], device, autocast_dtype=None
) -> list[float]:
    """Mean token loss of each micro-batch, on the last stage (an empty list elsewhere)."""
    comm = P2P(p, shape, device)
    losses = []
    for mb in range(num_mb):
        inp = comm.recv_forward()
        tokens, labels = batch(mb)
        with _autocast(device, autocast_dtype):
            if p.is_last_stage:
                losses.append(model.loss(tokens, labels, hidden=inp).float().mean())
            else:
                comm.send_forward(model(tokens, hidden=inp))
    return losses
