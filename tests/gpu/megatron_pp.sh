#!/usr/bin/env bash
# The Megatron engine's PP/DP code path on one GPU (tests/gpu/megatron_pp.py). Before it, from the
# repository root, the workloads to compare against (optional; the comparison is skipped without):
#   mkdir -p .before && git archive COMMIT workloads/mflow_workloads | tar -x --strip-components=1 -C .before
set -uo pipefail
source tests/gpu/env.sh
W=${W:-/tmp/mflow-gpu-work}
python3 tests/gpu/megatron_pp.py "$W/pp" "$OUT" 2>&1 | grep -v -i "warn\|Writing\|Loading" | tee "$OUT/megatron_pp.log"
