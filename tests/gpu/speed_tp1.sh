#!/usr/bin/env bash
# Training speed of the Llama-3.2-1B shape at TP=1 on one GPU, in one call:
#
#   MFLOW=path/to/mflow tests/gpu/speed_tp1.sh check bench run:NAME:KNOBS ...
#
# check:            tests/gpu/check_fusions.py (the engine's own fusions against references)
# bench:            tests/gpu/bench_train.py on shards written by `mflow model` + `mflow convert --tp 1`
#                   (BENCH_VARIANTS, comma-separated; `base` is plain Megatron-Core)
# run:NAME:KNOBS[:ITERATIONS]: `mflow run` of specs/llama-1b-tp2.toml with tp = 1 and one GPU, up to the train
#                   stage (200 iterations unless given, global batch 8, seq 4096), MFLOW_MEGATRON_KNOBS=KNOBS
#                   (`default` for the engine's defaults) and, when KNOBS has mbsN, micro_batch_size N
# The last lines are a table: one row per run (median TFLOP/s per GPU by the Megatron-Core 0.19
# formula and tokens/s over iterations 3..200, losses at iterations 1 and 200, validation losses).
set -uo pipefail
source tests/gpu/env.sh
export CI=true MFLOW_PYTHON=python3
W=${W:-/tmp/mflow-gpu-work}; mkdir -p "$W" "$OUT/runs"
MFLOW=${MFLOW:-mflow}
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
python3 -c 'import torch, megatron.core; print("torch", torch.__version__, "megatron-core", megatron.core.__version__)'

# The shipped 2-GPU spec at tp = 1 on one GPU, without evaluate and export, one checkpoint at the end.
# With a .corpus/ folder (a copy of the spec's input files, made with `git archive`), the data
# stage reads that copy: runs of different calls then train on the same tokens while the tree
# changes (the spec's inputs are the repository's own sources and docs).
SPEC=specs/.llama-1b-tp1-speed.toml
corpus=()
[ -d .corpus ] && corpus=(-e '/^inputs = /s#"\.\./#"../.corpus/#g')
awk '/^\[stages.evaluate\]/ {exit} {print}' specs/llama-1b-tp2.toml \
    | sed -e 's/^tp = 2/tp = 1/' -e 's/gpus = 2/gpus = 1/' -e 's/^save_interval = .*/save_interval = 200/' "${corpus[@]}" > "$SPEC"

shards() {
    [ -d "$W/hf" ] || "$MFLOW" model init:llama-1b "$W/hf" > /dev/null || exit 1
    [ -d "$W/tp1" ] || "$MFLOW" convert "$W/hf" "$W/tp1" --tp 1 > /dev/null || exit 1
}

run_one() {  # name knobs [iterations]
    local name=$1 knobs=$2 iters=${3:-200} mbs=4 sets=()
    [[ $knobs =~ mbs([0-9]+) ]] && mbs=${BASH_REMATCH[1]}
    knobs=$(echo "$knobs" | tr '+' ',' | sed -E 's/(^|,)mbs[0-9]+//; s/^,//')
    sets+=(--set "stages.train.micro_batch_size=$mbs" --set "stages.train.iterations=$iters")
    stamp "run $name: knobs ${knobs} micro-batch $mbs"
    local env=()
    [ "$knobs" != default ] && env=(MFLOW_MEGATRON_KNOBS="$knobs")
    env "${env[@]}" "$MFLOW" run "$SPEC" "${sets[@]}" --force train > "$OUT/runs/$name.log" 2>&1
    echo "exit $?" >> "$OUT/runs/$name.log"
    tail -4 "$OUT/runs/$name.log"
    # The newest training metrics (the run just made).
    local m; m=$(find specs/.mflow/runs -path '*train*' -name metrics.jsonl -printf '%T@ %p\n' | sort -rn | head -1 | cut -d' ' -f2-)
    cp "$m" "$OUT/runs/$name.metrics.jsonl"
    stamp "run $name: done"
}

for what in "$@"; do
    case $what in
    check) stamp "check"; python3 tests/gpu/check_fusions.py 2>&1 | grep -E "^CHECK|Error|error:" ;;
    bench)
        shards; stamp "bench"
        python3 -m torch.distributed.run --nproc-per-node=1 tests/gpu/bench_train.py "$W/tp1" "$OUT/bench.jsonl" \
            "${BENCH_VARIANTS:-base+acc2,default+acc2}" 2>&1 | grep -E "^BENCH|^PROFILE|Error" | cut -c1-400 ;;
    run:*) IFS=: read -r _ name knobs iters <<< "$what"; run_one "$name" "$knobs" "$iters" ;;
    *) echo "unknown part $what" >&2; exit 2 ;;
    esac
done
stamp "all done"
python3 tests/gpu/speed_table.py "$OUT" | tee "$OUT/table.txt"
(cd "$OUT" && tar czf runs.tgz runs && rm -rf runs)
