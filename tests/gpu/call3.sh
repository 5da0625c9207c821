#!/usr/bin/env bash
# GPU validation, part 3: Megatron kill/resume cycle, the 1B-shape run with checkpoint save and resume
# through the entry point, and the bf16 gradient-buffer variant.
set -uo pipefail
source tests/gpu/env.sh
W=${W:-/tmp/mflow-gpu-work}; t0=$(date +%s)
python3 tests/gpu/prepare.py "$W" --big 2>&1 | grep -v -i "warn\|Writing\|Loading"
echo "prepare done at $(( $(date +%s) - t0 ))s"
python3 tests/gpu/train_resume.py "$W" "$OUT" megatron "$W/sh_llama_tiny_tp2_bfloat16" 60 256 bf16 > "$OUT/resume.log" 2>&1
grep -E "RESUME|Error\b|resumed" "$OUT/resume.log" | tail -8
echo "resume done at $(( $(date +%s) - t0 ))s"
python3 tests/gpu/train_big.py "$W" "$OUT" > "$OUT/big.log" 2>&1
grep -E "BIG|Error\b|checkpoint|resumed" "$OUT/big.log" | tail -12
echo "big done at $(( $(date +%s) - t0 ))s"
python3 -m torch.distributed.run --nproc-per-node=2 tests/gpu/bench_train.py "$W/sh_llama_1b_tp2_bfloat16" "$OUT/bench.jsonl" base,bf16_grads,bf16_grads+ce_fusion+fused_adam+swiglu_fusion 2>&1 | grep -E "BENCH|Error\b"
echo "all done at $(( $(date +%s) - t0 ))s"
