"""GPU check of the shards `mflow convert` writes: Megatron-Core's GPTModel (local spec, no Transformer
Engine) loads them with load_state_dict(strict=True) at TP=1 and TP=2 and its logits match
transformers' forward of the original Hugging Face model.

    MFLOW=path/to/mflow python3 tests/gpu/ckpt_megatron_check.py WORKDIR OUT.jsonl

Driver (this command): `mflow model init:<preset>` and `mflow convert --tp 1/2` for each preset,
HF fp32 reference logits on one GPU (stored as safetensors next to the models), then one torchrun per
TP (1 and 2 processes) running this file with --worker. Each worker case prints one JSON line:
fp32 must be within MAX_ABS_DIFF of HF, bf16 must have cosine >= MIN_COSINE and the same argmax
wherever HF's top-2 margin exceeds 0.1 (random-init models have many near-ties elsewhere).
Exits non-zero unless every case passed. CKPT_PRESETS picks presets (default llama-1b,qwen2-tiny);
--prepare-only stops after conversion and references (runs on CPU too).
"""

import json
import os
import shutil
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "workloads"))

PRESETS = [p for p in os.environ.get("CKPT_PRESETS", "llama-1b,qwen2-tiny").split(",") if p]
TPS = (1, 2)
PRECISIONS = ("float32", "bfloat16")
MAX_ABS_DIFF = 1e-4
MIN_COSINE = 0.999
BATCH, SEQ = 2, 128


def emit(out_path, record):
    line = json.dumps(record)
    print(line, flush=True)
    with open(out_path, "a") as f:
        f.write(line + "\n")


def mflow(*args):
    binary = os.environ.get("MFLOW")
    if not binary or not os.access(binary, os.X_OK):
        sys.exit(f"MFLOW={binary!r} is not an executable: point MFLOW at the mflow binary")
    t0 = time.time()
    subprocess.run([binary, *args], check=True)
    return time.time() - t0


def reference(hf_dir, ref_path, device):
    """HF fp32 logits on a fixed batch (TF32 off), stored with the batch as safetensors."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    vocab = json.load(open(os.path.join(hf_dir, "config.json")))["vocab_size"]
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        logits = hf(tokens.to(device)).logits.float().cpu()
    del hf
    save_file({"tokens": tokens, "logits": logits.contiguous()}, ref_path)


def prepare(work, out_path):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for preset in PRESETS:
        hf = os.path.join(work, f"hf_{preset}")
        for stale in [hf, *(os.path.join(work, f"sh_{preset}_tp{tp}") for tp in TPS)]:
            shutil.rmtree(stale, ignore_errors=True)
        init_s = mflow("model", f"init:{preset}", hf)
        convert_s = {tp: mflow("convert", hf, os.path.join(work, f"sh_{preset}_tp{tp}"), "--tp", str(tp)) for tp in TPS}
        t0 = time.time()
        reference(hf, os.path.join(work, f"ref_{preset}.safetensors"), device)
        emit(out_path, {"step": "prepare", "preset": preset, "init_s": round(init_s, 2),
                        "convert_s": {f"tp{tp}": round(s, 2) for tp, s in convert_s.items()},
                        "hf_reference_s": round(time.time() - t0, 2)})
    if device == "cuda":
        torch.cuda.empty_cache()


def judge(logits, ref):
    """Figures of one case, given Megatron and HF logits [b, s, vocab]."""
    from parity import compare

    top2 = ref.topk(2, dim=-1).values
    # positions where HF's top-2 margin exceeds 0.1 are not decided by rounding; counted as integers
    # because a float mean of all-true comes out as 0.99999994 on CUDA
    confident = (top2[..., 0] - top2[..., 1]) > 0.1
    same = logits.argmax(-1) == ref.argmax(-1)
    return {**compare(logits, ref), "argmax_match": same.sum().item() / same.numel(),
            "confident_positions": int(confident.sum().item()),
            "confident_argmax_mismatches": int((confident & ~same).sum().item())}


def passed(precision, r):
    if precision == "float32":
        return r["max_abs_diff"] <= MAX_ABS_DIFF
    return r["cosine"] >= MIN_COSINE and r["confident_argmax_mismatches"] == 0


def worker(work, out_path):
    """One torchrun process: every preset at this world size's TP, fp32 and bf16."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from safetensors.torch import load_file

    from parity import megatron_logits  # builds GPTModel via the Megatron engine's model.py, strict load, TP gather

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    tp = dist.get_world_size()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)
    ok = True
    for preset in PRESETS:
        ref = load_file(os.path.join(work, f"ref_{preset}.safetensors"))
        tokens, hf_logits = ref["tokens"].cuda(), ref["logits"].cuda()
        shards = os.path.join(work, f"sh_{preset}_tp{tp}")
        for precision in PRECISIONS:
            r = {"step": "check", "preset": preset, "tp": tp, "precision": precision,
                 "shard_dtype": json.load(open(os.path.join(shards, "mflow-checkpoint.json")))["dtype"]}
            t0 = time.time()
            try:
                logits, _ = megatron_logits(ps, preset, shards, tp, precision, tokens)
                r.update(strict_load=True, **judge(logits, hf_logits))
                r["passed"] = passed(precision, r)
                del logits
            except Exception as e:  # noqa: BLE001 - record the case and go on with the next
                r.update(error=f"{type(e).__name__}: {str(e)[:800]}", passed=False)
            r["seconds"] = round(time.time() - t0, 2)
            ok &= r["passed"]
            if dist.get_rank() == 0:
                emit(out_path, r)
        del ref, tokens, hf_logits
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 2:
        sys.exit(__doc__)
    work, out_path = (os.path.abspath(a) for a in args)
    if "--worker" in sys.argv:
        return worker(work, out_path)
    os.makedirs(work, exist_ok=True)
    open(out_path, "w").close()
    t0 = time.time()
    prepare(work, out_path)
    if "--prepare-only" in sys.argv:
        return
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(ROOT, "workloads"),
                                                                     os.environ.get("PYTHONPATH")])))
    launched_ok = True
    for tp in TPS:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}",
               os.path.abspath(__file__), "--worker", work, out_path]
        launched_ok &= subprocess.run(cmd, env=env).returncode == 0
    cases = [json.loads(line) for line in open(out_path) if '"step": "check"' in line]
    expected = len(PRESETS) * len(TPS) * len(PRECISIONS)
    ok = launched_ok and len(cases) == expected and all(c["passed"] for c in cases)
    emit(out_path, {"step": "summary", "passed": ok, "cases": len(cases), "expected": expected,
                    "failed": [f"{c['preset']} tp{c['tp']} {c['precision']}" for c in cases if not c["passed"]],
                    "seconds": round(time.time() - t0, 1)})
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
