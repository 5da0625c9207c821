"""Entry point: `python -m mflow_workloads.verify_export CONFIG.json` (one process, CPU).

Loads the exported HF directory with transformers and the shards through the reference model
(pipeline stages and tensor-parallel ranks merged in memory), compares logits on the prompts and greedy generation.
Passes when fp32 max |diff| <= 1e-4 (bf16 shards: cosine >= 0.999) and greedy tokens agree.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

from . import runtime, shards as S
from .config import load_verify_export
from .errors import GateError
from .reference.model import build
from .reference.parallel import single

FP32_MAX_ABS = 1e-4
BF16_MIN_COSINE = 0.999


def merged_reference(shards_dir: str):
    manifest = S.read_manifest(shards_dir)
    spec = S.spec_of(manifest)
    # Pipeline stages joined first (a trained pp > 1 model is exported as it is), then tp ranks.
    ranks = [
        S.merge_pp(
            [S.load_rank(shards_dir, manifest, t, s) for s in range(manifest["pp"])],
            manifest["layers_per_stage"],
            spec.share_embeddings_and_output_weights,
        )
        for t in range(manifest["tp"])
    ]
    state = S.split_tp(S.merge_tp(ranks, spec), spec, 1)[0]
    return build(spec, single(), state, tp=1).eval(), manifest, spec


@torch.no_grad()
def greedy(logits_fn, ids: list[int], steps: int) -> list[int]:
    out = list(ids)
    for _ in range(steps):
        out.append(int(logits_fn(torch.tensor([out]))[0, -1].argmax()))
    return out[len(ids) :]


def main(path: str) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    cfg = load_verify_export(path)
    torch.manual_seed(0)
    ref, manifest, spec = merged_reference(cfg.shards)
    hf = AutoModelForCausalLM.from_pretrained(cfg.hf, dtype=torch.float32).eval()
    tok_path = os.path.join(cfg.hf, "tokenizer.json")
    if not os.path.isfile(tok_path):
        tok_path = os.path.join(cfg.shards, "tokenizer", "tokenizer.json")
    tok = Tokenizer.from_file(tok_path)

    def hf_logits(t: torch.Tensor) -> torch.Tensor:
        return hf(t).logits.float()[..., : spec.vocab_size]

    max_abs, a_all, b_all, per_prompt, match = 0.0, [], [], [], True
    with torch.no_grad():
        for prompt in cfg.prompts:
            ids = tok.encode(prompt).ids or [0]
            t = torch.tensor([ids])
            a, b = ref.full_logits(t).float(), hf_logits(t)
            max_abs = max(max_abs, (a - b).abs().max().item())
            a_all.append(a.flatten())
            b_all.append(b.flatten())
            g_ref, g_hf = greedy(ref.full_logits, ids, cfg.max_new_tokens), greedy(hf_logits, ids, cfg.max_new_tokens)
            match &= g_ref == g_hf
            per_prompt.append(
                {
                    "prompt": prompt,
                    "reference": tok.decode(g_ref),
                    "hf": tok.decode(g_hf),
                    "greedy_match": g_ref == g_hf,
                }
            )
    cosine = F.cosine_similarity(torch.cat(a_all), torch.cat(b_all), dim=0).item()
    fp32 = manifest["dtype"] == "float32"
    logits_ok = max_abs <= FP32_MAX_ABS if fp32 else cosine >= BF16_MIN_COSINE
    result = {
        "max_abs_diff": max_abs,
        "cosine": cosine,
        "greedy_match": match,
        "passed": logits_ok and match,
        "criterion": f"max_abs_diff <= {FP32_MAX_ABS}" if fp32 else f"cosine >= {BF16_MIN_COSINE}",
        "dtype": manifest["dtype"],
        "prompts": per_prompt,
    }
    os.makedirs(cfg.output, exist_ok=True)
    tmp = os.path.join(cfg.output, ".verification.json.partial")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, os.path.join(cfg.output, "verification.json"))
    if not result["passed"]:
        raise GateError(
            f"export verification failed: max |diff| {max_abs:.3g}, cosine {cosine:.6f}, "
            f"greedy match {match} ({result['criterion']})",
            "the exported HF weights do not reproduce the shards; see verification.json",
        )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m mflow_workloads.verify_export CONFIG.json", file=sys.stderr)
        sys.exit(2)
    sys.exit(runtime.run_main(main, sys.argv[1]))
