#!/usr/bin/env bash
# GPU validation, part 1: conversion parity (TP=1/2, fp32/bf16, tiny llama/qwen2 and the Llama-3.2-1B
# shape), Megatron vs reference first-step loss, and a Megatron train + SIGKILL + resume cycle.
# Run on a 2-GPU machine from the repository root with megatron-core and blake3 wheels in .whl/.
set -uo pipefail
source tests/gpu/env.sh
W=${W:-/tmp/mflow-gpu-work}
# BIG: prepare.py's size option, --big (the Llama-3.2-1B shape too) unless set to something else.
python3 -c 'import torch, megatron.core, transformers; print("torch", torch.__version__, "mcore", megatron.core.__version__, "transformers", transformers.__version__, "gpus", torch.cuda.device_count())'
t0=$(date +%s)
python3 tests/gpu/prepare.py "$W" "${BIG:---big}" 2>&1 | grep -v -i "warn\|Writing\|Loading" | tee "$OUT/prepare.log"
echo "prepare took $(( $(date +%s) - t0 ))s"
python3 -m torch.distributed.run --nproc-per-node=2 tests/gpu/parity.py "$W" "$OUT/parity.json" 2>&1 \
  | grep -E "PARITY|Error|error|Traceback" | tee "$OUT/parity.log"
echo "parity done at $(( $(date +%s) - t0 ))s"
python3 tests/gpu/train_resume.py "$W" "$OUT" megatron "$W/sh_llama_tiny_tp2_bfloat16" 60 256 bf16 > "$OUT/resume.log" 2>&1
grep -E "RESUME|Error|error\b" "$OUT/resume.log" | tail -20
echo "resume done at $(( $(date +%s) - t0 ))s"
