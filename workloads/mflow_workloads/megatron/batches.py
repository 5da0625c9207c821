"""The Megatron engine's data: GPTDataset over the dataset's prefixes, cut into micro-batches at
the sample positions the reference engine reads too (data.first_sample: dp rank d reads the
contiguous slice d of every global batch), and the forward step with its loss.
"""

from __future__ import annotations

import collections
import os

import torch

from .. import data as D
from ..config import TrainConfig


def stage_needs(pp_rank: int, pp: int) -> tuple[bool, bool]:
    """(reads tokens, reads labels): the first stage embeds tokens, the last computes the loss;
    a middle stage reads no data, as in Megatron's pretrain_gpt."""
    return pp_rank == 0, pp_rank == pp - 1


class MinimalTokenizer:
    """What GPTDataset reads from a tokenizer: vocab size and the end-of-document id."""

    def __init__(self, vocab_size: int, eod: int):
        self.vocab_size, self.eod = vocab_size, eod
        self.unique_identifiers = {"class": "mflow", "vocab_size": vocab_size, "eod": eod}


def build_datasets(cfg: TrainConfig, meta: dict, dp: int):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    dcfg = GPTDatasetConfig(
        random_seed=cfg.seed,
        sequence_length=cfg.seq_length,
        # The prefixes training.read_inputs checked every token id of (data.check_splits).
        blend_per_split=[*(([os.path.join(cfg.data, s)], None) for s in D.TRAINING_SPLITS), None],
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        tokenizer=MinimalTokenizer(meta["vocab_size"], meta["eod_id"]),
        path_to_cache=os.path.join(cfg.scratch, "dataset_cache"),
        mid_level_dataset_surplus=0.005,
    )
    sizes = [cfg.iterations * cfg.global_batch_size, cfg.eval_iters * cfg.global_batch_size, None]
    train_ds, valid_ds, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, dcfg).build()
    return train_ds, valid_ds


def batches(
    ds, dp: int, dp_rank: int, gbs: int, mbs: int, start_iter: int, pp_rank: int = 0, pp: int = 1, device="cuda"
):
    """Micro-batches of one data-parallel rank from global iteration `start_iter` on: the samples
    of data.first_sample, which the reference engine reads too. Each stage gets only what it uses
    (stage_needs); a middle stage's micro-batches are empty, but still one per schedule step."""
    tokens, labels = stage_needs(pp_rank, pp)
    keys = (("tokens", "position_ids") if tokens else ()) + (("labels", "loss_mask") if labels else ())
    it = start_iter
    while True:
        for m in range(gbs // (mbs * dp)):
            first = D.first_sample(it, m, gbs, mbs, dp, dp_rank)
            items = [ds[first + i] for i in range(mbs)] if keys else []
            yield {k: torch.stack([x[k] for x in items]).to(device, non_blocking=True) for k in keys}
        it += 1


class Prefetch:
    """Micro-batches read on the host ahead of their step (`ahead`), moved to the device when
    used: the engine reads the next step's while the GPU still runs the queued kernels of this
    one, so that the next step's first kernels do not wait for the dataset."""

    def __init__(self, it, device="cuda"):
        self.it, self.device, self.ready = it, device, collections.deque()

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        b = self.ready.popleft() if self.ready else next(self.it)
        return {k: v.to(self.device, non_blocking=True) for k, v in b.items()}

    def ahead(self, n: int) -> None:
        while len(self.ready) < n:
            self.ready.append(next(self.it))


def forward_step(data_iterator, model):
    b = next(data_iterator)
    # Stages after the first take their input from the previous stage (the schedule sets it).
    out = model(b.get("tokens"), b.get("position_ids"), None, labels=b.get("labels"))
    if "loss_mask" not in b:  # not the last stage: `out` is the hidden state sent on
        return out, None
    mask = b["loss_mask"].float()

    def loss_func(output_tensor):
        loss = (output_tensor.float() * mask).sum() / mask.sum().clamp(min=1)
        # A copy: the schedule divides the returned loss by num_microbatches in place, which a
        # detach() (same storage) would report too.
        return loss, {"lm loss": loss.detach().clone()}

    return out, loss_func
