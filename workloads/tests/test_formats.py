"""Dataset and shard readers: agreement with Megatron's reader, and clear errors on bad input."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from mflow_workloads import config as CFG, data as D, shards as S
from mflow_workloads.errors import ConfigError, DatasetError, ShardsError
from mflow_workloads.schedule import lr_at


def test_reader_agrees_with_megatron_indexed_dataset(assets):
    mcore = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    prefix = os.path.join(assets["data"], "train")
    ours, theirs = D.IndexedDataset(prefix), mcore.IndexedDataset(prefix)
    assert len(ours) == len(theirs) > 10
    for i in (0, 1, len(ours) // 2, len(ours) - 1):
        assert np.array_equal(ours.document(i), theirs[i])


def test_samples_are_deterministic_and_cover_an_epoch(assets):
    a = D.SampleSource(os.path.join(assets["data"], "train"), 64, 7, True)
    b = D.SampleSource(os.path.join(assets["data"], "train"), 64, 7, True)
    assert np.array_equal(a.sample(123), b.sample(123))
    starts = {a._window(k) for k in range(a.per_epoch)}
    assert starts == set(range(a.per_epoch))
    assert a.sample(0).shape == (65,)


def test_truncated_index_is_rejected(assets, tmp_path):
    prefix = str(tmp_path / "bad")
    shutil.copy(os.path.join(assets["data"], "valid.bin"), prefix + ".bin")
    with open(os.path.join(assets["data"], "valid.idx"), "rb") as f:
        head = f.read(40)
    with open(prefix + ".idx", "wb") as f:
        f.write(head)
    with pytest.raises(DatasetError, match="truncated"):
        D.IndexedDataset(prefix)


def test_manifest_path_cannot_escape(assets, tmp_path):
    d = tmp_path / "sh"
    shutil.copytree(assets["sh1"], d)
    m = json.loads((d / S.MANIFEST).read_text())
    m["files"][0]["path"] = "../model_tp00_pp000.safetensors"
    (d / S.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ShardsError, match="does not match"):
        S.read_manifest(str(d))


def test_corrupt_shard_is_named(assets, tmp_path):
    d = tmp_path / "sh"
    shutil.copytree(assets["sh1"], d)
    f = d / "model_tp00_pp000.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    m = S.read_manifest(str(d))
    with pytest.raises(ShardsError, match=r"model_tp00_pp000\.safetensors: blake3"):
        S.load_rank(str(d), m, 0)


def test_missing_config_key_is_named(assets, tmp_path):
    from conftest import train_config

    path = train_config(assets, str(tmp_path / "run"))
    cfg = json.loads(Path(path).read_text())
    del cfg["warmup_iterations"]
    Path(path).write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="missing key 'warmup_iterations'"):
        CFG.load_train(path)


def test_lr_schedule_follows_megatron():
    assert lr_at(0, 1.0, 0.1, 10, 100, "cosine") == 0.0
    assert lr_at(10, 1.0, 0.1, 10, 100, "cosine") == pytest.approx(1.0)
    assert lr_at(55, 1.0, 0.1, 10, 100, "cosine") == pytest.approx(0.55)
    assert lr_at(100, 1.0, 0.1, 10, 100, "linear") == pytest.approx(0.1)
    assert lr_at(200, 1.0, 0.1, 10, 100, "cosine") == pytest.approx(0.1)
    assert lr_at(50, 1.0, 0.1, 10, 100, "constant") == 1.0
