#!/usr/bin/env bash
# GPU check of Rust-written shards: mflow model init + mflow convert --tp 1/2, then Megatron-Core loads
# them strictly and matches transformers (fp32 and bf16). Run from the repository root on a machine
# with 2 GPUs and the megatron-core and blake3 wheels in .whl/:
#   MFLOW=path/to/mflow bash tests/gpu/ckpt_megatron_check.sh
set -uo pipefail
source tests/gpu/env.sh
: "${MFLOW:?set MFLOW to the mflow binary}"
python3 -c 'import torch, megatron.core, transformers; print("torch", torch.__version__, "mcore", megatron.core.__version__, "transformers", transformers.__version__, "gpus", torch.cuda.device_count())'
python3 tests/gpu/ckpt_megatron_check.py "${W:-/tmp/mflow-gpu-work}/ckpt" "$OUT/ckpt_megatron_check.jsonl" 2>&1 \
  | grep -v -i "warn\|Loading\|^\s*$"
