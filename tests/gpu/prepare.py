"""Makes the HF models, mflow shards and dataset the GPU validation uses (CPU/GPU, one process).

python tests/gpu/prepare.py WORKDIR [--big]
"""

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "workloads", "tests"))
sys.path.insert(0, os.path.join(ROOT, "workloads"))  # fixtures_lib imports mflow_workloads
import fixtures_lib as FL  # noqa: E402

# Llama-3.2-1B shape (tied embeddings, rope theta 5e5 with llama3 scaling) and two tiny models.
MODELS = {
    "llama_tiny": dict(arch="llama", layers=2, hidden=256, heads=8, kv_heads=2, ffn=704),
    "llama_tiny_tied_scaled": dict(arch="llama", layers=2, hidden=256, heads=8, kv_heads=2, ffn=704, tied=True,
                                   llama3_scaling=True, max_pos=16384),
    "qwen2_tiny": dict(arch="qwen2", layers=2, hidden=224, heads=14, kv_heads=2, ffn=512, rope_theta=1e6),
    "llama_1b": dict(arch="llama", layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, tied=True,
                     llama3_scaling=True, max_pos=131072, vocab=128256, init_range=0.02),
}


def main():
    work = sys.argv[1]
    big = "--big" in sys.argv
    os.makedirs(work, exist_ok=True)
    tok = FL.make_tokenizer(os.path.join(work, "tok"))
    FL.make_dataset(os.path.join(work, "data"), tok)
    names = [n for n in MODELS if big or n != "llama_1b"]
    for name in names:
        kw = dict(MODELS[name])
        hf = os.path.join(work, f"hf_{name}")
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            FL.make_hf_model(hf, tok, **kw)
        for tp in (1, 2):
            for dtype in os.environ.get("PREP_DTYPES", "float32,bfloat16").split(","):
                if name == "llama_1b" and os.environ.get("PREP_1B_TP") and str(tp) != os.environ["PREP_1B_TP"]:
                    continue
                FL.convert_hf_to_shards(hf, os.path.join(work, f"sh_{name}_tp{tp}_{dtype}"), tp, dtype)
        print("prepared", name, flush=True)
    json.dump(names, open(os.path.join(work, "models.json"), "w"))


if __name__ == "__main__":
    main()
