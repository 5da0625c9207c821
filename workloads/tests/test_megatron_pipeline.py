"""Pipeline and data parallelism of the Megatron engine, checked on CPU.

- The layer split and the data slices are pure functions: checked against the converter's
  layout and against data.first_sample (the reference engine's slices).
- With megatron-core importable, every rank of (tp, pp, dp) = (2,2,1), (1,2,2), (1,4,1) is
  simulated in this one process over torch's fake process group: Megatron's parallel_state gives
  it the coordinates and groups the reference engine computes, and Megatron's GPTModel for that
  stage (pre_process/post_process, the layers Megatron builds there) loads the stage's shard with
  strict=True, tied and untied. Shards come from the `mflow convert` binary when it is built.
The schedule itself (1F1B over NCCL) needs CUDA: see tests/gpu/megatron_pp.py.
"""

import os

import pytest
import torch

import fixtures_lib as FL
from conftest import REPO
from mflow_workloads import data as D, shards as S
from mflow_workloads.errors import ConfigError
from mflow_workloads.megatron import batches as MB, model as MM
from mflow_workloads.reference import parallel as RP

LAYOUTS = [(2, 2, 1), (1, 2, 2), (1, 4, 1)]  # (tp, pp, dp)


def _binary():
    for cand in (
        os.environ.get("MFLOW_BIN"),
        os.path.join(REPO, "target", "release", "mflow"),
        os.path.join(REPO, "target", "debug", "mflow"),
    ):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


@pytest.fixture(scope="module")
def stage_shards(assets, tmp_path_factory):
    d = tmp_path_factory.mktemp("mpp")
    binary = _binary()
    out = {"binary": binary is not None}
    for tied in (False, True):
        hf = FL.make_hf_model(
            str(d / f"hf-{tied}"), assets["tok"], layers=4, hidden=64, heads=4, kv_heads=2, ffn=128, tied=tied, seed=12
        )
        for tp, pp in {(t, p) for t, p, _ in LAYOUTS}:
            dst = str(d / f"{tied}-tp{tp}-pp{pp}")
            out[tied, tp, pp] = (
                FL.convert_with_binary(hf, dst, tp, "float32", pp=pp, binary=binary)
                if binary
                else FL.convert_hf_to_shards(hf, dst, tp, pp=pp)
            )
    return out


def test_layer_split_is_the_converters(stage_shards):
    assert MM.layers_per_stage(4, 2) == [2, 2] and MM.layers_per_stage(4, 4) == [1] * 4
    with pytest.raises(ConfigError, match="not divisible"):
        MM.layers_per_stage(4, 3)
    for tied in (False, True):
        m = S.read_manifest(stage_shards[tied, 2, 2])
        MM.check_stage_split(m, 2, 2)
        assert m["layers_per_stage"] == MM.layers_per_stage(4, 2)
        with pytest.raises(ConfigError, match="tp=2 pp=2"):
            MM.check_stage_split(m, 2, 1)
        uneven = dict(m, layers_per_stage=[3, 1])
        with pytest.raises(ConfigError, match=r"\[3, 1\]"):
            MM.check_stage_split(uneven, 2, 2)


class _Samples:
    """A dataset whose sample k is k, recording what was read."""

    def __init__(self):
        self.read = []

    def __getitem__(self, k):
        self.read.append(k)
        t = torch.full((4,), k)
        return {"tokens": t, "labels": t + 1, "loss_mask": torch.ones(4), "position_ids": torch.arange(4)}


@pytest.mark.parametrize("dp", [1, 2])
def test_dp_ranks_read_the_reference_slices(dp):
    gbs, mbs, iters, start = 8, 2, 3, 1
    per_rank = gbs // (mbs * dp)
    union = []
    for d in range(dp):
        ds = _Samples()
        it = MB.batches(ds, dp, d, gbs, mbs, start, device="cpu")
        for i in range(start, start + iters):
            for m in range(per_rank):
                b = next(it)
                first = D.first_sample(i, m, gbs, mbs, dp, d)
                assert b["tokens"][:, 0].tolist() == list(range(first, first + mbs))
        union += ds.read
        assert ds.read == sorted(ds.read) and len(ds.read) == iters * gbs // dp
    # Together the dp ranks read every sample of each global batch once: the same samples as dp = 1.
    assert sorted(union) == list(range(start * gbs, (start + iters) * gbs))


def test_prefetch_reads_ahead_in_order():
    gbs, mbs = 8, 2
    ds = _Samples()
    it = MB.Prefetch(MB.batches(ds, 1, 0, gbs, mbs, 0, device="cpu"), device="cpu")
    first = [next(it)["tokens"][:, 0].tolist() for _ in range(4)]  # iteration 0
    assert first == [[0, 1], [2, 3], [4, 5], [6, 7]] and len(ds.read) == 8
    it.ahead(4)  # iteration 1 is read now, before the step that uses it
    assert ds.read == list(range(16))
    it.ahead(2)  # already that far ahead: nothing more read
    assert len(ds.read) == 16
    assert [next(it)["tokens"][:, 0].tolist() for _ in range(5)] == [[8, 9], [10, 11], [12, 13], [14, 15], [16, 17]]


def test_each_stage_reads_only_what_it_uses():
    gbs, mbs, pp = 8, 2, 3
    seen = {}
    for s in range(pp):
        ds = _Samples()
        it = MB.batches(ds, 1, 0, gbs, mbs, 0, s, pp, device="cpu")
        seen[s] = [sorted(next(it)) for _ in range(gbs // mbs)], len(ds.read)
    assert seen[0] == ([["position_ids", "tokens"]] * 4, 8)
    assert seen[1] == ([[]] * 4, 0)  # one (empty) micro-batch per schedule step, no reads
    assert seen[2] == ([["labels", "loss_mask"]] * 4, 8)


def _megatron():
    """An environment without megatron-core or torch's fake process group skips."""
    pytest.importorskip("megatron.core.parallel_state")
    pytest.importorskip("torch.testing._internal.distributed.fake_pg")


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "tp{}-pp{}-dp{}".format(*x))
def test_megatron_builds_each_stage_from_its_shard(stage_shards, layout, monkeypatch):
    _megatron()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    tp, pp, dp = layout
    # GPTModel moves a tied last-stage copy to CUDA for its build-time all-reduce; on CPU the
    # fake group's collectives are no-ops, so the tensor stays where it is.
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    for tied in (False, True):
        m = S.read_manifest(stage_shards[tied, tp, pp])
        spec = S.spec_of(m)
        MM.check_stage_split(m, tp, pp)
        for rank in range(tp * pp * dp):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp * pp * dp)
            try:
                ps.initialize_model_parallel(tp, pp, create_gloo_process_groups=False)
                MM.check_megatron_layout(rank, tp, dp, pp)
                t, _, s = RP.coordinates(rank, tp, dp, pp)
                assert ps.is_rank_in_embedding_group() == (s in (0, pp - 1))
                if pp > 1 and s in (0, pp - 1):
                    emb = dist.get_process_group_ranks(ps.get_embedding_group())
                    assert emb == next(g for g in RP.group_ranks(tp, dp, pp)["embedding"] if rank in g)
                config = MM.transformer_config(spec, tp, pp, "fp32")
                config.use_cpu_initialization = True
                model = MM.build_model(spec, config, tp, 32, "sdpa", device="cpu")
                assert (model.pre_process, model.post_process) == (s == 0, s == pp - 1)
                MM.check_model_stage(model, m, s)
                MM.load_shard(model, stage_shards[tied, tp, pp], m, t, s)  # strict
                names = set(model.state_dict())
                assert ("embedding.word_embeddings.weight" in names) == (s == 0)
                # Tied and pipelined: the last stage owns a copy of the embedding as its output
                # layer, marked so that finalize_model_grads sums its gradient with the first's.
                assert ("output_layer.weight" in names) == (s == pp - 1 and (not tied or pp > 1))
                if tied and pp > 1 and s == pp - 1:
                    assert getattr(model.shared_embedding_or_output_weight(), "shared_embedding", False)
            finally:
                ps.destroy_model_parallel()
                dist.destroy_process_group()
