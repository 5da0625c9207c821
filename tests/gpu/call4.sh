#!/usr/bin/env bash
# GPU validation, part 4: Megatron SIGKILL + resume (tiny llama, TP=2) and the 1B-shape checkpoint
# save/resume timings through the entry point.
set -uo pipefail
source tests/gpu/env.sh
W=${W:-/tmp/mflow-gpu-work}; t0=$(date +%s)
PREP_DTYPES=bfloat16 PREP_1B_TP=2 python3 tests/gpu/prepare.py "$W" --big 2>&1 | grep -v -i "warn\|Writing\|Loading"
echo "prepare done at $(( $(date +%s) - t0 ))s"
python3 tests/gpu/train_resume.py "$W" "$OUT" megatron "$W/sh_llama_tiny_tp2_bfloat16" 60 256 bf16 > "$OUT/resume.log" 2>&1
grep -E "RESUME|Error\b|resumed" "$OUT/resume.log" | tail -8
echo "resume done at $(( $(date +%s) - t0 ))s"
BIG_ITERS=4,6 python3 tests/gpu/train_big.py "$W" "$OUT" > "$OUT/big.log" 2>&1
grep -E "BIG|Error\b|checkpoint|resumed" "$OUT/big.log" | tail -12
echo "all done at $(( $(date +%s) - t0 ))s"
