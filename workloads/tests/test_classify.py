"""How a workload's exception becomes mflow's failure class (events.classify_exception)."""

import errno
import os

import pytest

from mflow_workloads.errors import ConfigError, DatasetError, GateError
from mflow_workloads.events import classify_exception


class SafetensorError(Exception):
    """What safetensors raises when a write fails (its message wraps the OS error)."""


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ESTALE])
def test_storage_that_failed_is_infra(code):
    # The volume under the stage filled up, went read-only or stopped answering: not the
    # stage's fault, and another attempt can succeed.
    assert classify_exception(OSError(code, os.strerror(code), "/mflow/x/scratch/ck")) == "infra"


def test_storage_errors_wrapped_by_libraries_are_infra():
    wrapped = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert classify_exception(wrapped) == "infra"
    torch_save = RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0: file write failed")
    assert classify_exception(torch_save) == "infra"


def test_the_stages_own_errors_stay_user():
    assert classify_exception(FileNotFoundError(errno.ENOENT, "No such file or directory", "data.bin")) == "user"
    assert classify_exception(PermissionError(errno.EACCES, "Permission denied", "/x")) == "user"
    assert classify_exception(ValueError("seq_length must be positive")) == "user"


def test_other_classes_are_kept():
    assert classify_exception(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")) == "oom"
    assert classify_exception(RuntimeError("Gloo connectFullMesh failed: connection reset by peer")) == "infra"
    assert classify_exception(GateError("val_ppl 31.2 is not < 20")) == "gate"
    # A workload's own error keeps its class, whatever its words.
    assert classify_exception(DatasetError("cannot write the index: No space left on device")) == "user"


# The rule of docs/exit-codes.md: what may pass is infra, what the same attempt meets again is
# user; system errors by their errno, never by the words around them.
def os_error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


@pytest.mark.parametrize(
    "exc, cls",
    [
        (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), "infra"),
        (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), "infra"),
        (TimeoutError("timed out"), "infra"),
        (os_error(errno.ENOSPC), "infra"),
        (os_error(errno.EMFILE), "infra"),
        (os_error(errno.EAGAIN), "infra"),
        (RuntimeError("[gloo] Connection closed by peer"), "infra"),
        (InterruptedError("terminated by SIGTERM; checkpoint saved at iteration 3"), "infra"),
        (MemoryError(), "oom"),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
        (FileNotFoundError(errno.ENOENT, "No such file", "/data/peer-timeout.bin"), "user"),
        (PermissionError(errno.EACCES, "Permission denied"), "user"),
        (os_error(errno.ENAMETOOLONG), "user"),
        (os_error(errno.E2BIG), "user"),
        (ValueError("shapes do not match"), "user"),
        (ValueError("timeout must be positive"), "user"),
        (ConfigError("bad key"), "user"),
        (GateError("val_loss 4.2 is not < 3"), "gate"),
    ],
)
def test_each_exception_gets_the_class_of_the_rule(exc, cls):
    assert classify_exception(exc) == cls
