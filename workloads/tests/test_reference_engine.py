"""The reference engine matches HF and is the same function at tp=1 and tp=2."""

import json
import os

import torch

from conftest import HERE, torchrun
from mflow_workloads import shards as S
from mflow_workloads.reference import model as RM, parallel as RP


def _result(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_tp1_tp2_loss_and_grad_norm_agree(assets):
    worker = os.path.join(HERE, "tp_loss_worker.py")
    one = _result(torchrun(1, [worker, assets["sh1"], assets["data"]]))
    two = _result(torchrun(2, [worker, assets["sh2"], assets["data"]]))
    assert abs(one["loss"] - two["loss"]) <= 1e-5
    assert abs(one["grad_norm"] - two["grad_norm"]) <= 1e-5 * max(1.0, one["grad_norm"])
    assert 4.0 < one["loss"] < 9.0  # a random model on a 512-token vocab starts near ln(512)


def test_logits_match_transformers(assets):
    from transformers import AutoModelForCausalLM

    m = S.read_manifest(assets["sh1"])
    model = RM.build(S.spec_of(m), RP.single(), S.load_rank(assets["sh1"], m, 0)).eval()
    hf = AutoModelForCausalLM.from_pretrained(assets["hf"], dtype=torch.float32).eval()
    tokens = torch.randint(0, S.spec_of(m).vocab_size, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (model.full_logits(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= 1e-5


def test_merge_then_split_reproduces_the_tp2_shards(assets):
    m = S.read_manifest(assets["sh2"])
    spec = S.spec_of(m)
    ranks = [S.load_rank(assets["sh2"], m, t) for t in range(2)]
    again = S.split_tp(S.merge_tp(ranks, spec), spec, 2)
    for r in range(2):
        assert ranks[r].keys() == again[r].keys()
        for k in ranks[r]:
            assert torch.equal(ranks[r][k], again[r][k]), k


def test_wrong_qkv_layout_is_detected(assets):
    """A converter that concatenates q, k, v instead of interleaving per group must not pass."""
    from transformers import AutoModelForCausalLM

    m = S.read_manifest(assets["sh1"])
    state = S.load_rank(assets["sh1"], m, 0)
    key = "decoder.layers.0.self_attention.linear_qkv.weight"
    state[key] = state[key].flip(0)
    model = RM.build(S.spec_of(m), RP.single(), state).eval()
    hf = AutoModelForCausalLM.from_pretrained(assets["hf"], dtype=torch.float32).eval()
    tokens = torch.randint(0, 500, (1, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (model.full_logits(tokens) - hf(tokens).logits).abs().max().item() > 1e-3
