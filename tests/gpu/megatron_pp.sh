#!/usr/bin/env bash
# The Megatron engine's PP/DP code path on one GPU (tests/gpu/megatron_pp.py). Before it, from the
# repository root: `git show COMMIT:workloads/mflow_workloads/megatron_engine.py > .before/megatron_engine.py`
# with COMMIT the engine to compare against (optional; skipped when absent).
set -uo pipefail
source tests/gpu/env.sh
W=${W:-/tmp/mflow-gpu-work}
python3 tests/gpu/megatron_pp.py "$W/pp" "$OUT" 2>&1 | grep -v -i "warn\|Writing\|Loading" | tee "$OUT/megatron_pp.log"
