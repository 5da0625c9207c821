#!/usr/bin/env bash
# Tokenization benchmark, side by side in one run on one corpus and tokenizer:
#   mflow (`mflow dataset`, THREADS threads and 1 thread) against gigatoken (the engine of
#   Megatron-LM's preprocess_data_fast.py), REPS rounds alternating; then once each the Python
#   `tokenizers` pipeline (the reference ids), the `tokenizers` crate's own encode path, and
#   mflow over the crate's pre-tokenizer (`--word-memo-mib 0`).
#
# usage: benches/tokenize/run.sh BENCH_DIR [THREADS=2] [REPS=3]
#   BENCH_DIR comes from `python benches/tokenize/make_corpus.py BENCH_DIR` (outside the repo).
#   Python is $MFLOW_PYTHON (tokenizers, numpy, gigatoken). SKIP_SLOW=1 leaves out the three
#   single runs but the Python reference. Prints a markdown table (report.py).
set -euo pipefail
D=$(realpath "$1"); THREADS=${2:-2}; REPS=${3:-3}
PY=${MFLOW_PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
cargo build --release -q -p mflow-data --examples
EX=${CARGO_TARGET_DIR:-target}/release/examples
C=$D/corpus.jsonl TOK=$D/tokenizer
rm -rf "$D"/runs && mkdir -p "$D"/runs

measure() { # NAME CMD...: whole-process wall time, CPU and peak RSS from /usr/bin/time -v, and
  # the machine's load average before and after (other work on the machine inflates wall time)
  local name=$1; shift
  echo "== $name: $*" >&2
  cut -d' ' -f1-3 /proc/loadavg > "$D/runs/$name.load"
  /usr/bin/time -v "$@" > "$D/runs/$name.out" 2> "$D/runs/$name.time"
  cut -d' ' -f1-3 /proc/loadavg >> "$D/runs/$name.load"
}
mflow() { # NAME THREADS [ARGS...]
  local name=$1 threads=$2; shift 2
  rm -rf "$D/runs/$name-out"
  measure "$name" "$EX/mflow-dataset" "$C" --tokenizer "$TOK" --out "$D/runs/$name-out" --threads "$threads" \
    --splits 100,0,0 "$@"
}

for rep in $(seq 1 "$REPS"); do
  mflow "mflow.$rep" "$THREADS"
  RAYON_NUM_THREADS=$THREADS measure "gigatoken.$rep" "$PY" "$HERE/gigatoken_pipeline.py" "$C" "$TOK/tokenizer.json" \
    "$D/runs/gigatoken"
  mflow "mflow-1thread.$rep" 1
done
RAYON_NUM_THREADS=$THREADS measure python "$PY" "$HERE/python_pipeline.py" "$C" "$TOK/tokenizer.json" "$D/runs/python" --fast
if [ "${SKIP_SLOW:-0}" != 1 ]; then
  measure ceiling "$EX/encode-ceiling" "$C" "$TOK/tokenizer.json" "$THREADS" default
  mflow mflow-crate-pretokenizer "$THREADS" --word-memo-mib 0
fi

# documents whose ids differ from the Python tokenizers library's
differing() { # NAME PREFIX
  if [ -e "$D/runs/$2.bin" ]; then
    "$PY" "$HERE/diff_docs.py" "$D/runs/python" "$D/runs/$2" > "$D/runs/$1.diff" || true
  fi
}
differing mflow mflow.1-out/train
differing mflow-1thread mflow-1thread.1-out/train
differing gigatoken gigatoken
differing mflow-crate-pretokenizer mflow-crate-pretokenizer-out/train
# mflow's output does not depend on its thread count
cmp "$D/runs/mflow.1-out/train.bin" "$D/runs/mflow-1thread.1-out/train.bin"
"$PY" "$HERE/report.py" "$D/runs" "$REPS"
