"""Megatron indexed datasets (`.bin` / `.idx`) read with numpy, and deterministic samples.

Sample `k` of a split is a window of `seq_length + 1` tokens. Training samples are drawn from a
per-epoch permutation seeded by (seed, epoch), so the sample at a global position depends only on
the seed and the position: a resumed run continues with exactly the samples it would have seen.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np
import torch

from .errors import DatasetError

IDX_MAGIC = b"MMIDIDX\x00\x00"
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
HEADER_BYTES = len(IDX_MAGIC) + 8 + 1 + 8 + 8


class IndexedDataset:
    """Read-only view of `<prefix>.idx` / `<prefix>.bin` (Megatron's MMIDIDX format)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        try:
            idx_size = os.path.getsize(idx_path)
            bin_size = os.path.getsize(bin_path)
        except OSError as e:
            raise DatasetError(f"{prefix}: missing .idx or .bin: {e}", "run the dataset stage first") from e
        with open(idx_path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[: len(IDX_MAGIC)] != IDX_MAGIC:
            raise DatasetError(f"{idx_path}: not a Megatron MMIDIDX index", "regenerate the dataset")
        off = len(IDX_MAGIC)
        (version,) = struct.unpack_from("<Q", head, off)
        (code,) = struct.unpack_from("<B", head, off + 8)
        seq_count, doc_count = struct.unpack_from("<QQ", head, off + 9)
        if version != 1 or code not in DTYPE_CODES:
            raise DatasetError(f"{idx_path}: version {version} dtype code {code} unsupported", "regenerate the dataset")
        # Bound the untrusted counts by the file size before mapping anything.
        need = HEADER_BYTES + seq_count * (4 + 8) + doc_count * 8
        if need > idx_size:
            raise DatasetError(
                f"{idx_path}: header claims {seq_count} sequences / {doc_count} documents, "
                f"needing {need} bytes, file has {idx_size}",
                "the index is truncated; regenerate it",
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        self.lengths = np.memmap(idx_path, np.int32, "r", HEADER_BYTES, (seq_count,))
        self.pointers = np.memmap(idx_path, np.int64, "r", HEADER_BYTES + seq_count * 4, (seq_count,))
        self.document_indices = np.memmap(idx_path, np.int64, "r", HEADER_BYTES + seq_count * 12, (doc_count,))
        n_tokens = int(self.lengths.sum(dtype=np.int64)) if seq_count else 0
        if n_tokens * self.dtype.itemsize != bin_size:
            raise DatasetError(
                f"{bin_path}: {bin_size} bytes but the index lists {n_tokens} tokens of {self.dtype.itemsize} bytes",
                "the .bin and .idx do not belong together; regenerate",
            )
        self.num_tokens = n_tokens
        self.tokens = np.memmap(bin_path, self.dtype, "r", 0, (n_tokens,)) if n_tokens else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return len(self.lengths)

    def document(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return np.asarray(self.tokens[start : start + int(self.lengths[i])])


def read_dataset_json(data_dir: str) -> dict[str, Any]:
    path = os.path.join(data_dir, "dataset.json")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DatasetError(f"{path}: cannot read: {e}", "point 'data' at a dataset stage output") from e
    if meta.get("format") != "mflow-dataset":
        raise DatasetError(f"{path}: format is {meta.get('format')!r}", "expected 'mflow-dataset'")
    for k in ("vocab_size", "eod_id"):
        if not isinstance(meta.get(k), int):
            raise DatasetError(f"{path}: key '{k}' missing or not an integer", "regenerate the dataset")
    return meta


def first_sample(iteration: int, micro_batch: int, gbs: int, mbs: int, dp: int, dp_rank: int) -> int:
    """Position of the first sample of a dp rank's micro-batch: global batch `iteration` holds
    samples [iteration * gbs, (iteration + 1) * gbs), and dp rank d its contiguous slice
    [d * gbs/dp, (d+1) * gbs/dp) of it, read mbs at a time. The ranks' slices are disjoint and
    together the whole batch, so every dp size consumes the same samples."""
    return iteration * gbs + dp_rank * (gbs // dp) + micro_batch * mbs


class SampleSource:
    """Fixed-length windows of one split; `shuffle` permutes windows per epoch from the seed."""

    def __init__(self, prefix: str, seq_length: int, seed: int, shuffle: bool, vocab_limit: int | None = None):
        self.ds = IndexedDataset(prefix)
        self.seq = seq_length
        self.seed = seed
        self.shuffle = shuffle
        self.per_epoch = (self.ds.num_tokens - 1) // seq_length
        if self.per_epoch < 1:
            raise DatasetError(
                f"{prefix}: {self.ds.num_tokens} tokens, fewer than seq_length+1 = {seq_length + 1}",
                "use a smaller seq_length or more text",
            )
        if vocab_limit is not None and self.ds.num_tokens:
            top = int(np.max(self.ds.tokens[: min(self.ds.num_tokens, 1 << 22)]))
            if top >= vocab_limit:
                raise DatasetError(
                    f"{prefix}: token id {top} >= model vocab {vocab_limit}", "tokenize with the model's tokenizer"
                )
        self._perm_epoch = -1
        self._perm = None

    def _window(self, k: int) -> int:
        epoch, j = divmod(k, self.per_epoch)
        if not self.shuffle:
            return j
        if epoch != self._perm_epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perm = rng.permutation(self.per_epoch)
            self._perm_epoch = epoch
        return int(self._perm[j])

    def sample(self, k: int) -> np.ndarray:
        start = self._window(k) * self.seq
        return np.asarray(self.ds.tokens[start : start + self.seq + 1], dtype=np.int64)

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, labels) of shape [count, seq] for samples first..first+count-1."""
        arr = np.stack([self.sample(first + i) for i in range(count)])
        t = torch.from_numpy(arr)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()
