"""Pipeline and data parallelism of the reference engine (gloo, fp32, spawned ranks).

- Megatron-Core's rank layout and groups; stages hold exactly what `mflow convert --pp` writes.
- One optimizer step on the same global batch at (tp, pp, dp) = (2,2,1), (1,2,2), (2,1,2) gives
  the loss, grad norm and updated weights of (1,1,1) within 1e-5, untied and tied (whose two
  copies stay bitwise equal), and the data-parallel ranks read disjoint slices of that batch.
- Over an epoch, dp = 1 and dp = 2 consume the same multiset of token windows.
- A rank SIGKILLed at pp = 2 resumes from the newest checkpoint and loses at most one interval.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

import fixtures_lib as FL
from conftest import HERE, REPO, python, read_json, read_jsonl, torchrun, train_config
from mflow_workloads import data as D, shards as S, training as T
from mflow_workloads.config import load_train
from mflow_workloads.errors import ConfigError
from mflow_workloads.reference import model as RM, parallel as RP

TOL = 1e-5
LAYOUTS = [(2, 2, 1), (1, 2, 2), (2, 1, 2)]  # (tp, pp, dp)
MODELS = ("untied", "tied")
WORKER = os.path.join(HERE, "pp_worker.py")
# AdamW's first step moves a weight by lr * g / (|g| + 1e-8): about lr for most, but for the few
# gradients near 1e-8 it magnifies float rounding (different summation orders across tp ranks)
# up to lr-sized differences. lr = 1e-4 keeps those under TOL; the gradients are compared too.
STEP = {
    "iterations": 1,
    "seq_length": 32,
    "micro_batch_size": 2,
    "global_batch_size": 8,
    "warmup_iterations": 0,
    "lr": 1e-4,
    "min_lr": 1e-5,
    "eval_interval": 1,
    "eval_iters": 1,
    "save_interval": 1,
}


@pytest.fixture(scope="module")
def pp_assets(assets, tmp_path_factory):
    """4-layer models (untied and tied) converted for every layout the tests train with."""
    d = tmp_path_factory.mktemp("pp")
    out = {"dir": d, "data": assets["data"], "sh2": assets["sh2"], "hf": {}}
    for name in MODELS:
        hf = FL.make_hf_model(
            str(d / f"hf-{name}"),
            assets["tok"],
            layers=4,
            hidden=64,
            heads=4,
            kv_heads=2,
            ffn=128,
            tied=name == "tied",
            seed=11 if name == "tied" else 10,
        )
        out["hf"][name] = hf
        for tp, pp in {(1, 1), (2, 2), (1, 2), (2, 1)}:
            out[name, tp, pp] = FL.convert_hf_to_shards(hf, str(d / f"{name}-tp{tp}-pp{pp}"), tp, pp=pp)
    return out


def merged(shards_dir: str) -> dict[str, torch.Tensor]:
    """The unsharded pp = 1 state of a shard set (true vocab)."""
    m = S.read_manifest(shards_dir)
    return _merge(m, lambda t, s: S.load_rank(shards_dir, m, t, s))


def _merge(m: dict, rank_state) -> dict[str, torch.Tensor]:
    spec = S.spec_of(m)
    ranks = [
        S.merge_pp(
            [rank_state(t, s) for s in range(m["pp"])], m["layers_per_stage"], spec.share_embeddings_and_output_weights
        )
        for t in range(m["tp"])
    ]
    return S.merge_tp(ranks, spec)


def merged_grads(run: str, shards_dir: str, reads: list) -> dict[str, torch.Tensor]:
    """The gradients of dp rank 0's replica, unsharded like the weights; every other dp rank's
    must be bitwise the same (averaged over dp)."""
    from safetensors.torch import load_file

    m = S.read_manifest(shards_dir)
    grads = {
        (r["tp_rank"], r["pp_rank"], r["dp_rank"]): load_file(os.path.join(run, f"grads_rank{i:02}.safetensors"))
        for i, r in enumerate(reads)
    }
    for (t, s, _), g in grads.items():
        assert g.keys() == grads[t, s, 0].keys() and all(torch.equal(v, grads[t, s, 0][k]) for k, v in g.items())
    return _merge(m, lambda t, s: grads[t, s, 0])


def tied_copies_equal(shards_dir: str) -> bool:
    m = S.read_manifest(shards_dir)
    last = m["pp"] - 1
    return all(
        torch.equal(
            S.load_rank(shards_dir, m, t, 0)["embedding.word_embeddings.weight"],
            S.load_rank(shards_dir, m, t, last)["output_layer.weight"],
        )
        for t in range(m["tp"])
    )


def one_step(pp_assets, tp: int, pp: int, dp: int) -> dict:
    """One optimizer step of both models at a layout, in one launch."""
    cfgs = []
    for name in MODELS:
        run = str(pp_assets["dir"] / f"step-{name}-{tp}{pp}{dp}")
        shutil.rmtree(run, ignore_errors=True)
        cfgs.append(train_config(pp_assets, run, shards=pp_assets[name, tp, pp], tp=tp, pp=pp, dp=dp, **STEP))
    t0 = time.perf_counter()
    proc = torchrun(tp * pp * dp, [WORKER, *cfgs], timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = {"wall_s": time.perf_counter() - t0}
    for name, cfg in zip(MODELS, cfgs, strict=True):
        run = os.path.dirname(cfg)
        lines = read_jsonl(os.path.join(run, "metrics.jsonl"))
        train = next(x for x in lines if "loss" in x)
        reads = [read_json(os.path.join(run, f"samples_rank{r:02}.json")) for r in range(tp * pp * dp)]
        res[name] = {
            "loss": train["loss"],
            "grad_norm": train["grad_norm"],
            "val_loss": next(x["val_loss"] for x in lines if "val_loss" in x),
            "output": os.path.join(run, "output"),
            "reads": reads,
            "grads": merged_grads(run, pp_assets[name, tp, pp], reads),
        }
    return res


@pytest.fixture(scope="module")
def single(pp_assets):
    return one_step(pp_assets, 1, 1, 1)


def test_rank_layout_is_megatrons():
    # Megatron-Core's default order "tp-cp-ep-dp-pp": tp varies fastest, then dp, then pp.
    g = RP.group_ranks(tp=2, dp=2, pp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert RP.group_ranks(tp=1, dp=2, pp=4)["embedding"] == [[0, 6], [1, 7]]
    for rank in range(24):
        t, d, s = RP.coordinates(rank, 2, 3, 4)
        assert rank == s * 6 + d * 2 + t


def test_merge_and_split_stages_round_trip(pp_assets):
    for name in MODELS:
        full = merged(pp_assets[name, 1, 1])
        for tp, pp in ((1, 2), (2, 2)):
            assert merged(pp_assets[name, tp, pp]).keys() == full.keys()
            assert all(torch.equal(v, full[k]) for k, v in merged(pp_assets[name, tp, pp]).items())
        m = S.read_manifest(pp_assets[name, 1, 2])
        assert list(S.stage_layers(m, 1)) == [2, 3]


def _mflow_binary():
    for cand in (
        os.environ.get("MFLOW_BIN"),
        os.path.join(REPO, "target", "release", "mflow"),
        os.path.join(REPO, "target", "debug", "mflow"),
    ):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def test_stages_are_what_mflow_convert_writes(pp_assets, tmp_path):
    """The fixture converter, and so every stage the trainer builds, matches crates/mflow-ckpt's
    PP layout tensor for tensor; each stage loads with strict=True."""
    binary = _mflow_binary()
    if binary is None:
        pytest.skip("no mflow binary (build it, or set MFLOW_BIN)")
    for name in MODELS:
        ours = pp_assets[name, 2, 2]
        theirs = FL.convert_with_binary(pp_assets["hf"][name], str(tmp_path / name), 2, "float32", pp=2, binary=binary)
        m_ours, m_theirs = S.read_manifest(ours), S.read_manifest(theirs)
        assert m_theirs["layers_per_stage"] == m_ours["layers_per_stage"] == [2, 2]
        spec = S.spec_of(m_theirs)
        for s in range(2):
            for t in range(2):
                a, b = S.load_rank(ours, m_ours, t, s), S.load_rank(theirs, m_theirs, t, s)
                assert a.keys() == b.keys(), (name, t, s, sorted(a.keys() ^ b.keys()))
                assert all(torch.equal(a[k], b[k]) for k in a), (name, t, s)
                p = RP.Parallel(tp=2, pp=2, tp_rank=t, pp_rank=s)
                RM.build(spec, p, b, layers=2)  # strict


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "tp{}-pp{}-dp{}".format(*x))
def test_one_step_matches_a_single_process(pp_assets, single, layout):
    tp, pp, dp = layout
    res = one_step(pp_assets, tp, pp, dp)
    for name in MODELS:
        a, b = single[name], res[name]
        w0, w1, w2 = merged(pp_assets[name, 1, 1]), merged(a["output"]), merged(b["output"])
        assert w1.keys() == w2.keys()
        assert a["grads"].keys() == b["grads"].keys() == w1.keys()
        moved = max((w1[k] - w0[k]).abs().max().item() for k in w1)
        grad_max = max(g.abs().max().item() for g in a["grads"].values())
        figures = {
            "loss": abs(a["loss"] - b["loss"]),
            "grad_norm": abs(a["grad_norm"] - b["grad_norm"]),
            "val_loss": abs(a["val_loss"] - b["val_loss"]),
            "grads": max((a["grads"][k] - b["grads"][k]).abs().max().item() for k in w1),
            "weights": max((w1[k] - w2[k]).abs().max().item() for k in w1),
        }
        print(
            f"PARITY tp{tp}-pp{pp}-dp{dp} {name}: "
            + " ".join(f"{k}={v:.2e}" for k, v in figures.items())
            + f" (weights moved {moved:.2e}, largest grad {grad_max:.2e}; launch {res['wall_s']:.1f}s)"
        )
        assert moved > 5 * TOL, "the step must change the weights for the comparison to mean anything"
        assert all(v <= TOL for v in figures.values()), figures
        if name == "tied" and pp > 1:
            assert tied_copies_equal(b["output"])
        _check_dp_slices(a["reads"], b["reads"], dp)


def _check_dp_slices(single_reads, reads, dp):
    """Every rank of one dp coordinate that reads data reads the same samples; the dp ranks'
    samples are disjoint contiguous slices whose union is the single process's batch."""
    by_dp: dict[int, list] = {}
    for r in reads:
        if r["reads"]:
            firsts = [x["first"] for x in r["reads"]]
            assert by_dp.setdefault(r["dp_rank"], firsts) == firsts, "ranks of one replica read different data"
    assert sorted(by_dp) == list(range(dp))
    gbs = STEP["global_batch_size"]
    mbs = STEP["micro_batch_size"]
    slices = {d: sorted(f + i for f in firsts for i in range(mbs)) for d, firsts in by_dp.items()}
    for d, samples in slices.items():
        assert samples == list(range(d * gbs // dp, (d + 1) * gbs // dp))
    union = sorted(x for s in slices.values() for x in s)
    assert len(set(union)) == len(union)
    assert union == sorted(f + i for x in single_reads[0]["reads"] for f in [x["first"]] for i in range(mbs))


def test_epoch_consumes_the_same_tokens_at_dp1_and_dp2(pp_assets, tmp_path):
    seq, gbs = 32, 32
    per_epoch = D.SampleSource(os.path.join(pp_assets["data"], "train"), seq, 1234, True).per_epoch
    iters = per_epoch // gbs
    consumed = {}
    t0 = time.perf_counter()
    for dp in (1, 2):
        run = str(tmp_path / f"dp{dp}")
        cfg = train_config(
            pp_assets,
            run,
            shards=pp_assets["untied", 1, 1],
            tp=1,
            pp=1,
            dp=dp,
            iterations=iters,
            seq_length=seq,
            micro_batch_size=4,
            global_batch_size=gbs,
            eval_interval=iters,
            eval_iters=1,
            save_interval=iters,
        )
        proc = torchrun(dp, [WORKER, cfg], timeout=240)
        assert proc.returncode == 0, proc.stderr[-4000:]
        ranks = [read_json(os.path.join(run, f"samples_rank{r:02}.json")) for r in range(dp)]
        windows = [{w for x in r["reads"] for w in x["windows"]} for r in ranks]
        if dp == 2:
            assert not windows[0] & windows[1], "dp ranks must read disjoint samples"
        consumed[dp] = Counter(tuple(t) for r in ranks for x in r["reads"] for t in x["tokens"])
        assert sum(consumed[dp].values()) == iters * gbs
        assert len(set().union(*windows)) == iters * gbs  # within one epoch no window repeats
    print(f"EPOCH {iters} iterations x {gbs} samples of {per_epoch} windows; {time.perf_counter() - t0:.1f}s")
    assert consumed[1] == consumed[2]


def test_layout_mismatch_is_a_clear_error(pp_assets, tmp_path):
    cfg = load_train(train_config(pp_assets, str(tmp_path / "run"), shards=pp_assets["untied", 2, 1], tp=2, pp=2))
    with pytest.raises(ConfigError, match="have tp=2 pp=1 but the train config asks tp=2 pp=2"):
        T.check_layout(cfg, S.read_manifest(cfg.shards))


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the training worker with RANK=rank below the launcher (from /proc; torchrun
    starts its workers in sessions of their own)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):  # gone, or not a process
                parent[int(d)] = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
    below, frontier = set(), {launcher}
    while frontier:
        frontier = {c for c, pp in parent.items() if pp in frontier} - below
        below |= frontier
    for pid in below:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"mflow_workloads.train" in cmd and f"RANK={rank}".encode() in env:
            return pid
    return None


def _launch(cfg: str, run: str, port: int) -> subprocess.Popen:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        MFLOW_METRICS=os.path.join(run, "metrics.jsonl"),
        MFLOW_STATUS=os.path.join(run, "status.json"),
    )
    cmd = [
        python(),
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--node-rank=0",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "-m",
        "mflow_workloads.train",
        cfg,
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def test_sigkill_at_pp2_then_resume(pp_assets, tmp_path):
    iters, interval = 60, 10
    run = str(tmp_path / "run")
    cfg = train_config(
        pp_assets,
        run,
        shards=pp_assets["tied", 1, 2],
        tp=1,
        pp=2,
        dp=1,
        iterations=iters,
        seq_length=32,
        micro_batch_size=2,
        global_batch_size=8,
        save_interval=interval,
        eval_interval=30,
        eval_iters=1,
    )
    tracker = os.path.join(run, "scratch", "checkpoints", "latest_checkpointed_iteration.txt")
    port = 29900 + os.getpid() % 50
    first = _launch(cfg, run, port)
    killed_after = None
    deadline = time.time() + 120
    metrics = os.path.join(run, "metrics.jsonl")
    while first.poll() is None and time.time() < deadline:
        text = Path(tracker).read_text().strip() if os.path.exists(tracker) else ""
        logged = [x["iteration"] for x in read_jsonl(metrics)] if os.path.exists(metrics) else []
        # Mid-interval, so that the resumed run has iterations to redo.
        if text and int(text) >= 20 and logged and logged[-1] >= int(text) + 4:
            pid = _rank_pid(first.pid, 1)  # the last stage
            if pid:
                killed_after = int(Path(tracker).read_text())
                os.kill(pid, signal.SIGKILL)
                break
        time.sleep(0.02)
    first.communicate(timeout=120)
    assert killed_after is not None and killed_after < iters, "the run must be killed mid-training"
    assert first.returncode != 0
    before = read_jsonl(os.path.join(run, "metrics.jsonl"))
    loss_before = {x["iteration"]: x["loss"] for x in before if "loss" in x}
    last_before = max(loss_before)

    second = _launch(cfg, run, port + 50)
    _, err = second.communicate(timeout=180)
    assert second.returncode == 0, err.decode()[-4000:]
    after = read_jsonl(os.path.join(run, "metrics.jsonl"))[len(before) :]
    its = [x["iteration"] for x in after if "loss" in x]
    # Where the attempt resumed is its own figure, in its metrics; the output is the same either way.
    summary = read_json(os.path.join(run, "output", "train_summary.json"))
    assert "resumed_from" not in summary and "time_s" not in summary, summary
    resumed = [x for x in after if "train_time_s" in x][-1]["resumed_from"]
    assert resumed is not None and killed_after <= resumed <= last_before
    assert last_before - resumed <= interval, "at most one checkpoint interval may be lost"
    assert its == list(range(resumed + 1, iters + 1))
    # The redone iterations repeat the killed run's: same weights, optimizer state and data.
    redone = [x for x in after if "loss" in x and x["iteration"] in loss_before]
    assert redone
    for x in redone:
        assert abs(x["loss"] - loss_before[x["iteration"]]) <= 1e-6, x["iteration"]
    assert read_json(os.path.join(run, "status.json"))["checkpoint_iteration"] == iters
    out = os.path.join(run, "output")
    assert S.read_manifest(out)["pp"] == 2 and tied_copies_equal(out)
    ck = os.path.join(run, "scratch", "checkpoints", f"iter_{iters:07d}")
    assert sorted(os.listdir(ck)) == [
        "meta.json",
        "model_tp00_pp000.safetensors",
        "model_tp00_pp001.safetensors",
        "optim_tp00_pp000.safetensors",
        "optim_tp00_pp001.safetensors",
        "rng_rank00000.safetensors",
        "rng_rank00001.safetensors",
    ]
    print(
        f"RESUME killed after checkpoint {killed_after}, last logged {last_before}, resumed from {resumed}, "
        f"{len(redone)} iterations redone identically"
    )
