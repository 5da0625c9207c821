#!/usr/bin/env bash
# Tokenization benchmark: mflow-data against (a) the tokenizers crate's raw encode throughput and
# (b) the straightforward Python pipeline, side by side in one run on the same corpus.
#
# usage: benches/tokenize/run.sh BENCH_DIR [THREADS]
#   BENCH_DIR comes from `python benches/tokenize/make_corpus.py BENCH_DIR` (outside the repo).
#   Python is $MFLOW_PYTHON (tokenizers + numpy). Prints a markdown table (report.py).
set -euo pipefail
D=$(realpath "$1"); THREADS=${2:-2}
PY=${MFLOW_PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
cargo build --release -q -p mflow-data --examples
EX=${CARGO_TARGET_DIR:-target}/release/examples

measure() { # NAME CMD...: whole-process wall time and peak RSS from /usr/bin/time -v
  local name=$1; shift
  echo "== $name: $*" >&2
  /usr/bin/time -v "$@" > "$D/$name.out" 2> "$D/$name.time"
}

rm -rf "$D/mflow-out" "$D/python.bin" "$D/python.idx"
measure ceiling "$EX/encode-ceiling" "$D/corpus.jsonl" "$D/tokenizer/tokenizer.json" "$THREADS"
measure mflow "$EX/mflow-dataset" "$D/corpus.jsonl" --tokenizer "$D/tokenizer" --out "$D/mflow-out" \
  --threads "$THREADS" --splits 100,0,0
RAYON_NUM_THREADS=$THREADS measure python "$PY" "$HERE/python_pipeline.py" "$D/corpus.jsonl" \
  "$D/tokenizer/tokenizer.json" "$D/python"

# the two pipelines must have written the same dataset
cmp "$D/python.bin" "$D/mflow-out/train.bin"
cmp "$D/python.idx" "$D/mflow-out/train.idx"
echo "python and mflow outputs are byte-identical" >&2
"$PY" "$HERE/report.py" "$D"
