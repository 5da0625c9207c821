#!/usr/bin/env bash
# GPU validation, part 2: parity re-check, Megatron kill/resume, throughput variants at TP=2 and TP=1,
# and a Llama-3.2-1B-shape training run through the entry point with checkpoint save and resume.
set -uo pipefail
source tests/gpu/env.sh
W=${W:-/tmp/mflow-gpu-work}; t0=$(date +%s)
[ -f "$W/models.json" ] || python3 tests/gpu/prepare.py "$W" --big 2>&1 | grep -v -i "warn\|Writing\|Loading"
echo "prepare done at $(( $(date +%s) - t0 ))s"
PARITY_MODELS=${PARITY_MODELS:-llama_1b,qwen2_tiny} python3 -m torch.distributed.run --nproc-per-node=2 tests/gpu/parity.py "$W" "$OUT/parity2.json" 2>&1 \
  | grep -E "PARITY|Error|Traceback" | tee "$OUT/parity2.log"
echo "parity done at $(( $(date +%s) - t0 ))s"
python3 tests/gpu/train_resume.py "$W" "$OUT" megatron "$W/sh_llama_tiny_tp2_bfloat16" 60 256 bf16 > "$OUT/resume.log" 2>&1
grep -E "RESUME|Error\b" "$OUT/resume.log" | tail -8
echo "resume done at $(( $(date +%s) - t0 ))s"
python3 -m torch.distributed.run --nproc-per-node=2 tests/gpu/bench_train.py "$W/sh_llama_1b_tp2_bfloat16" "$OUT/bench.jsonl" 2>&1 | grep -E "BENCH|Error\b"
echo "bench tp2 done at $(( $(date +%s) - t0 ))s"
python3 -m torch.distributed.run --nproc-per-node=1 tests/gpu/bench_train.py "$W/sh_llama_1b_tp1_bfloat16" "$OUT/bench.jsonl" base,ce_fusion+fused_adam+swiglu_fusion 2>&1 | grep -E "BENCH|Error\b"
echo "bench tp1 done at $(( $(date +%s) - t0 ))s"
python3 tests/gpu/train_big.py "$W" "$OUT" 2>&1 | grep -E "BIG|Error\b|checkpoint|resumed" | tail -12
echo "all done at $(( $(date +%s) - t0 ))s"
