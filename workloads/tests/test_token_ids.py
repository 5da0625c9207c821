"""Every token id a stage reads is checked against the model's vocabulary before it starts
(data.check_token_ids): deep in the file, negative int32 ids, in every split read, by every stage."""

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

import fixtures_lib as FL
from conftest import WORKLOADS, python, read_json, train_config
from mflow_workloads import data as D, shards as S
from mflow_workloads.errors import DatasetError

FOUR_MI = 1 << 22
VOCAB = 1024


def valid_tokens(n: int, vocab: int = VOCAB, dtype=np.uint16) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) % vocab).astype(dtype)


def write(prefix: str, tokens: np.ndarray, dtype, docs: int = 4) -> str:
    """`tokens` as `docs` documents of a Megatron MMIDIDX dataset."""
    FL.write_indexed(prefix, np.array_split(tokens, docs), dtype=dtype)
    return prefix


def test_id_equal_to_vocab_after_four_mi_tokens_uint16(tmp_path):
    tokens = valid_tokens(FOUR_MI + 1000)
    pos = FOUR_MI + 17
    tokens[pos] = VOCAB
    prefix = write(str(tmp_path / "train"), tokens, np.uint16)
    with pytest.raises(DatasetError) as e:
        D.check_token_ids(D.IndexedDataset(prefix), VOCAB)
    msg = str(e.value)
    assert f"{prefix}.bin" in msg
    assert f"token id {VOCAB} at token index {pos}" in msg
    assert f"vocab size {VOCAB}" in msg
    assert e.value.code == "mflow::workload::dataset" and e.value.cls == "user"


def test_negative_id_in_int32(tmp_path):
    tokens = valid_tokens(5000, dtype=np.int32)
    tokens[4321] = -3
    prefix = write(str(tmp_path / "valid"), tokens, np.int32)
    with pytest.raises(DatasetError, match=r"valid\.bin: token id -3 at token index 4321 .*vocab size 1024"):
        D.check_token_ids(D.IndexedDataset(prefix), VOCAB)


def test_first_bad_id_is_named_across_chunks(tmp_path):
    tokens = valid_tokens(10_000, dtype=np.int32)
    tokens[[2500, 2600, 9000]] = [-1, VOCAB + 7, -9]
    prefix = write(str(tmp_path / "train"), tokens, np.int32, docs=5)
    with pytest.raises(DatasetError) as e:
        D.check_token_ids(D.IndexedDataset(prefix), VOCAB, chunk=1000)
    msg = str(e.value)
    # The first bad id, in the third chunk; documents are 2000 tokens, so it is in sequence 1.
    assert "token id -1 at token index 2500 (sequence 1)" in msg and f"{prefix}.bin" in msg


def test_valid_dataset_passes(tmp_path):
    prefix = write(str(tmp_path / "train"), valid_tokens(FOUR_MI + 1000), np.uint16)
    D.check_token_ids(D.IndexedDataset(prefix), VOCAB)
    D.check_token_ids(D.IndexedDataset(prefix), VOCAB, chunk=4096)  # chunk edges
    i32 = write(str(tmp_path / "i32"), valid_tokens(3000, dtype=np.int32), np.int32)
    D.check_token_ids(D.IndexedDataset(i32), VOCAB, chunk=1000)
    # vocab - 1 is the largest id that fits.
    edge = valid_tokens(100)
    edge[-1] = VOCAB - 1
    D.check_token_ids(D.IndexedDataset(write(str(tmp_path / "edge"), edge, np.uint16)), VOCAB)


def test_sample_source_checks_the_whole_file(tmp_path):
    """SampleSource (the reference engine's and evaluate's reader) applies the same check."""
    tokens = valid_tokens(FOUR_MI + 1000)
    tokens[-1] = 5000
    prefix = write(str(tmp_path / "train"), tokens, np.uint16)
    with pytest.raises(DatasetError, match=f"token id 5000 at token index {FOUR_MI + 999} "):
        D.SampleSource(prefix, 64, 1, True, VOCAB)
    D.SampleSource(prefix, 64, 1, True)  # no vocabulary given: no check


def test_a_rewritten_file_is_checked_again(tmp_path):
    prefix = str(tmp_path / "train")
    write(prefix, valid_tokens(4000), np.uint16)
    D.check_token_ids(D.IndexedDataset(prefix), VOCAB)
    bad = valid_tokens(4000)
    bad[3999] = VOCAB
    os.remove(prefix + ".bin")  # a new file: a new identity for the memo of checked files
    write(prefix, bad, np.uint16)
    with pytest.raises(DatasetError, match="at token index 3999"):
        D.check_token_ids(D.IndexedDataset(prefix), VOCAB)


# -- the stages


def _bad_data(assets, tmp_path, split: str, bad_id: int, dtype=np.uint16) -> tuple[str, int]:
    """A copy of the assets' dataset whose `split` gains a document of 4 Mi valid ids then `bad_id`;
    returns the directory and the bad id's token index."""
    data = str(tmp_path / "data")
    shutil.copytree(assets["data"], data)
    prefix = os.path.join(data, split)
    ds = D.IndexedDataset(os.path.join(assets["data"], split))
    docs = [ds.document(i).astype(dtype) for i in range(len(ds))]
    tail = valid_tokens(FOUR_MI + 1, vocab=500, dtype=dtype)
    tail[-1] = bad_id
    for ext in (".bin", ".idx"):
        os.remove(prefix + ext)
    FL.write_indexed(prefix, [*docs, tail], dtype=dtype)
    return data, ds.num_tokens + FOUR_MI


def _run(module: str, cfg_path: str, tmp_path) -> tuple[subprocess.CompletedProcess, dict]:
    status = tmp_path / "status.json"
    env = dict(os.environ, PYTHONPATH=WORKLOADS, MFLOW_STATUS=str(status), CUDA_VISIBLE_DEVICES="")
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([python(), "-m", module, cfg_path], env=env, capture_output=True, text=True, timeout=300)
    return proc, read_json(status)


def test_training_stage_refuses_a_bad_id_deep_in_train(assets, tmp_path):
    vocab = S.spec_of(S.read_manifest(assets["sh1"])).vocab_size
    data, pos = _bad_data(assets, tmp_path, "train", vocab)
    cfg = train_config(assets, str(tmp_path / "run"), shards=assets["sh1"], data=data, tp=1, iterations=2)
    proc, status = _run("mflow_workloads.train", cfg, tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "error[mflow::workload::dataset]" in proc.stderr
    want = f"{data}/train.bin: token id {vocab} at token index {pos}"
    assert want in proc.stderr and f"vocab size {vocab}" in proc.stderr
    assert status["class"] == "user" and want in status["message"]
    assert not os.path.exists(os.path.join(tmp_path, "run", "scratch", "checkpoints"))


def test_training_checks_the_valid_split_too(assets, tmp_path):
    """training.read_inputs, which both engines (reference and Megatron) call before building
    anything, checks every split they read."""
    from mflow_workloads import config as CFG, training as T

    data, pos = _bad_data(assets, tmp_path, "valid", -3, dtype=np.int32)
    for engine in ("reference", "megatron"):
        cfg = CFG.load_train(train_config(assets, str(tmp_path / engine), data=data, engine=engine))
        with pytest.raises(DatasetError, match=rf"valid\.bin: token id -3 at token index {pos} "):
            T.read_inputs(cfg)


def test_evaluate_stage_refuses_a_bad_id(assets, tmp_path):
    vocab = S.spec_of(S.read_manifest(assets["sh1"])).vocab_size
    data, pos = _bad_data(assets, tmp_path, "test", vocab + 3)
    out = str(tmp_path / "out")
    cfg = {
        "stage": "evaluate",
        "engine": "reference",
        "shards": assets["sh1"],
        "data": data,
        "output": out,
        "tp": 1,
        "pp": 1,
        "seq_length": 64,
        "micro_batch_size": 4,
        "eval_iters": 1,
        "splits": ["valid", "test"],
        "baseline": None,
        "prompts": [],
        "max_new_tokens": 1,
        "precision": "fp32",
    }
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(cfg))
    proc, status = _run("mflow_workloads.evaluate", str(path), tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    want = f"{data}/test.bin: token id {vocab + 3} at token index {pos}"
    assert want in proc.stderr and status["class"] == "user"
    assert not os.path.exists(os.path.join(out, "metrics.json"))
