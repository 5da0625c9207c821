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


# Tokens per chunk of the id check: 2 MiB of uint16 (4 MiB of int32), so that its max after its
# min reads from cache (1 Mi tokens measured faster than 4 or 16 Mi; 50 chunks per 100 MB of uint16).
ID_CHECK_CHUNK = 1 << 20
# The splits a training stage reads (both engines): train for the steps, valid for validation.
TRAINING_SPLITS = ("train", "valid")
# .bin files this process has checked, by identity and vocabulary: a reader built again over the
# same file (each engine's own SampleSource after read_inputs) does not scan it a second time.
_checked_ids: set[tuple] = set()


def check_token_ids(ds: IndexedDataset, vocab_size: int, chunk: int = ID_CHECK_CHUNK) -> None:
    """Every token id of `ds` must lie in [0, vocab_size): a vocabulary-parallel embedding (the
    reference's, Megatron's) masks the ids outside its rows, so an id the model does not have can
    train without an error. Reads the whole .bin once, `chunk` tokens at a time (min and max of
    each, never the whole file in memory), and only where the dtype can hold a bad id. Raises a
    DatasetError naming the file, the first bad id, its token index and the vocabulary size."""
    bin_path = ds.prefix + ".bin"
    dtype = ds.dtype
    if ds.num_tokens == 0:
        return
    if dtype.kind == "u" and np.iinfo(dtype).max < vocab_size:
        return  # e.g. uint16 under a vocabulary of 65536 or more: no id can be out of range
    try:
        st = os.stat(bin_path)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, dtype.str, vocab_size)
    except OSError:
        key = None
    if key in _checked_ids:
        return
    tokens = ds.tokens
    for start in range(0, ds.num_tokens, chunk):
        part = tokens[start : start + chunk]
        lo, hi = part.min(), part.max()
        # Written so that a NaN of a float dataset fails it too.
        if lo >= 0 and hi < vocab_size:
            continue
        bad = ~((part >= 0) & (part < vocab_size))
        i = int(np.argmax(bad))
        pos = start + i
        tid = part[i].item()
        starts = np.asarray(ds.pointers) // dtype.itemsize
        seq = int(np.searchsorted(starts, pos, side="right")) - 1
        where = f" (sequence {seq})" if 0 <= seq < len(ds) else ""
        raise DatasetError(
            f"{bin_path}: token id {tid} at token index {pos}{where} is outside [0, vocab size {vocab_size})",
            "the dataset was tokenized with another tokenizer, or the file is corrupt: "
            "run the dataset stage again with the model's tokenizer",
        )
    if key is not None:
        _checked_ids.add(key)


def check_splits(data_dir: str, splits, vocab_size: int) -> None:
    """check_token_ids over `<data_dir>/<split>` for each split a stage reads, before it starts."""
    for split in splits:
        check_token_ids(IndexedDataset(os.path.join(data_dir, split)), vocab_size)


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
        if vocab_limit is not None:
            check_token_ids(self.ds, vocab_limit)
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
