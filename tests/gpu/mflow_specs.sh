#!/usr/bin/env bash
# The shipped specs through the mflow binary on a machine with 2 GPUs, plus the training-speed
# variants on Rust-converted Llama-1B shards.
#
#   MFLOW=path/to/mflow tests/gpu/mflow_specs.sh gpt 1b bench
#
# gpt:   specs/gpt-tp2.toml as users run it (engine auto -> Megatron-Core), then the no-op rerun
# 1b:    specs/llama-1b-tp2.toml
# bench: tests/gpu/bench_train.py on shards written by `mflow model` + `mflow convert` (BENCH_VARIANTS)
# Results: run records and logs under $OUT.
set -uo pipefail
source tests/gpu/env.sh
export CI=true MFLOW_PYTHON=python3
W=${W:-/tmp/mflow-gpu-work}; mkdir -p "$W"
MFLOW=${MFLOW:-mflow}
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

run_spec() {  # name spec
    local name=$1 spec=$2
    stamp "$name: start"
    /usr/bin/time -f "$name first run: %e s wall" "$MFLOW" run "$spec" > "$OUT/$name.log" 2>&1; echo "exit $?" >> "$OUT/$name.log"
    tail -25 "$OUT/$name.log"
    /usr/bin/time -f "$name second run: %e s wall" "$MFLOW" run "$spec" > "$OUT/$name-rerun.log" 2>&1; echo "exit $?" >> "$OUT/$name-rerun.log"
    tail -3 "$OUT/$name-rerun.log"
    local wd; wd="$(dirname "$spec")/.mflow"
    mkdir -p "$OUT/$name-runs"
    cp -r "$wd/runs/." "$OUT/$name-runs/" 2>/dev/null
    for st in train evaluate export; do
        local o; o=$("$MFLOW" output "$spec" "$st" 2>/dev/null) || continue
        cp "$o"/*.json "$OUT/$name-runs/" 2>/dev/null
        mkdir -p "$OUT/$name-runs/$st"; cp "$o"/*.json "$o"/*.jsonl "$OUT/$name-runs/$st/" 2>/dev/null
    done
    stamp "$name: done"
}

for what in "$@"; do
    case $what in
    gpt) "$MFLOW" doctor > "$OUT/doctor.log" 2>&1; cat "$OUT/doctor.log"; run_spec gpt specs/gpt-tp2.toml ;;
    1b) run_spec llama-1b specs/llama-1b-tp2.toml ;;
    bench)
        stamp "bench: shards"
        [ -d "$W/hf" ] || "$MFLOW" model init:llama-1b "$W/hf" > /dev/null || exit 1
        for tp in 1 2; do [ -d "$W/tp$tp" ] || "$MFLOW" convert "$W/hf" "$W/tp$tp" --tp $tp > /dev/null || exit 1; done
        stamp "bench: tp2"
        V=${BENCH_VARIANTS:-ce_fusion+fused_adam+swiglu_fusion}
        python3 -m torch.distributed.run --nproc-per-node=2 tests/gpu/bench_train.py "$W/tp2" "$OUT/bench.jsonl" "$V" 2>&1 | grep -E "^BENCH|^PROFILE|Error" | cut -c1-600
        stamp "bench: tp1"
        python3 -m torch.distributed.run --nproc-per-node=1 tests/gpu/bench_train.py "$W/tp1" "$OUT/bench.jsonl" "${BENCH_VARIANTS_TP1:-$V}" 2>&1 | grep -E "^BENCH|^PROFILE|Error" | cut -c1-600
        stamp "bench: done" ;;
    *) echo "unknown part $what" >&2; exit 2 ;;
    esac
done
