"""All-reduce of a two-rank tensor-parallel group on one host through shared memory.

Gloo moves every all-reduce through loopback TCP: about 1.3 ms of CPU per megabyte on a 2-core
machine, and the reference engine all-reduces an activation or its gradient twice per layer and
micro-batch. Here each rank copies its tensor into its own slot of a shared mapping, posts a
process-shared semaphore, waits for the peer's, and adds the peer's slot to its tensor. IEEE
addition is commutative, so both ranks hold a + b, bit for bit what gloo computes.

Each rank has two slots, used on alternate calls: a rank can be at most one call ahead of its
peer (it waits for the peer's post of the same call), so it never overwrites a slot the peer may
still be reading. Tensors larger than a slot, or of other dtypes, go through gloo.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import socket
import time
import uuid

import torch
import torch.distributed as dist

from ..errors import ParallelError

SLOT_BYTES = 4 << 20
HEADER = 4096
SEM_BYTES = 64  # sizeof(sem_t) is 32 on x86-64 and aarch64 glibc
DTYPES = (torch.float32, torch.float64)
WAIT_SLICE_S = 2.0


class PeerLost(ParallelError):
    """The peer stopped answering: an infrastructure failure, which mflow retries."""

    cls = "infra"


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc():
    lib = ctypes.CDLL(None, use_errno=True)
    for name in ("sem_init", "sem_post", "sem_timedwait", "sem_destroy"):
        if not hasattr(lib, name):
            raise OSError(f"{name} not found in the C library")
    lib.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
    lib.sem_post.argtypes = [ctypes.c_void_p]
    lib.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]
    return lib


class ShmPair:
    """The shared-memory channel of one two-rank group; `index` is this rank's place in it."""

    def __init__(self, mm: mmap.mmap, index: int, peer_pid: int, timeout_s: float):
        self._lib = _libc()
        self._mm = mm
        self.index, self.peer_pid, self.timeout_s = index, peer_pid, timeout_s
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        self._sems = [base + i * SEM_BYTES for i in range(2)]
        data = torch.frombuffer(mm, dtype=torch.uint8)[HEADER:]
        # slots[rank][parity], each SLOT_BYTES long
        self._slots = [
            [data[(2 * r + k) * SLOT_BYTES : (2 * r + k + 1) * SLOT_BYTES] for k in range(2)] for r in range(2)
        ]
        self._calls = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype in DTYPES and x.device.type == "cpu" and x.numel() * x.element_size() <= SLOT_BYTES

    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Returns a new tensor holding the sum (or max) of both ranks' `x`; `x` is left as it is."""
        parity = self._calls & 1
        self._calls += 1
        nbytes = x.numel() * x.element_size()
        mine = self._slots[self.index][parity][:nbytes].view(x.dtype)
        peer = self._slots[1 - self.index][parity][:nbytes].view(x.dtype)
        flat = x.reshape(-1)
        mine.copy_(flat)
        if self._lib.sem_post(self._sems[self.index]) != 0:
            raise OSError(ctypes.get_errno(), "sem_post failed")
        self._wait(self._sems[1 - self.index])
        if op == dist.ReduceOp.SUM:
            out = torch.add(flat, peer)
        elif op == dist.ReduceOp.MAX:
            # The same operand order on both ranks, so that both keep the same value even where
            # max is not symmetric (signed zeros).
            out = torch.maximum(
                self._slots[0][parity][:nbytes].view(x.dtype), self._slots[1][parity][:nbytes].view(x.dtype)
            )
        else:
            raise ValueError(f"shared-memory all-reduce supports SUM and MAX, not {op}")
        return out.view(x.shape)

    def _wait(self, sem: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        ts = _Timespec()
        while True:
            now = time.time() + WAIT_SLICE_S
            ts.tv_sec, ts.tv_nsec = int(now), int((now % 1) * 1e9)
            if self._lib.sem_timedwait(sem, ctypes.byref(ts)) == 0:
                return
            err = ctypes.get_errno()
            if err == 4:  # EINTR: a signal arrived (SIGTERM is handled at the next iteration)
                continue
            if err != 110:  # ETIMEDOUT
                raise OSError(err, "sem_timedwait failed")
            if not _alive(self.peer_pid):
                raise PeerLost(
                    f"tensor-parallel peer process {self.peer_pid} exited during an all-reduce",
                    "see the peer rank's error above; mflow retries infra failures",
                )
            if time.monotonic() > deadline:
                raise PeerLost(
                    f"tensor-parallel peer process {self.peer_pid} did not reach the all-reduce "
                    f"within {self.timeout_s:.0f} s",
                    "see the peer rank's log",
                )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def connect(group, ranks: list[int], rank: int, timeout_s: float = 600.0) -> ShmPair | None:
    """Sets up the channel of a two-rank group when both ranks run on this host and shared memory
    works; None (use gloo) otherwise. Every rank of the group must call it."""
    if len(ranks) != 2 or os.environ.get("MFLOW_TP_SHM", "1") == "0":
        return None
    index = ranks.index(rank)
    mm, path, ok = None, "", False
    if index == 0:
        path = os.path.join("/dev/shm", f"mflow-tp-{uuid.uuid4().hex}")
        try:
            mm = _create(path)
            ok = True
        except (OSError, ValueError):
            mm = None
    me = [socket.gethostname(), os.getpid(), path if ok else ""]
    both: list = [None, None]
    dist.all_gather_object(both, me, group=group)
    (host0, pid0, shared), (host1, pid1, _) = both
    usable = host0 == host1 and bool(shared)
    if usable and index == 1:
        try:
            fd = os.open(shared, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, HEADER + 4 * SLOT_BYTES)
            finally:
                os.close(fd)
        except OSError:
            mm = None
    # Both must agree before either uses the channel; the name is removed once both have mapped it.
    flags: list = [None, None]
    dist.all_gather_object(flags, mm is not None, group=group)
    if index == 0 and shared:
        with contextlib.suppress(OSError):
            os.unlink(shared)
    if not (usable and all(flags)):
        return None
    try:
        return ShmPair(mm, index, pid1 if index == 0 else pid0, timeout_s)
    except OSError:
        return None


def _create(path: str) -> mmap.mmap:
    size = HEADER + 4 * SLOT_BYTES
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # fail now rather than SIGBUS on a full /dev/shm later
        mm = mmap.mmap(fd, size)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    lib = _libc()
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    for i in range(2):
        if lib.sem_init(base + i * SEM_BYTES, 1, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
    return mm
