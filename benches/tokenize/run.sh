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

measure() { # NAME CMD...: whole-process wall time and peak RSS from /usr/bin/time -v, and the
  # machine's load average before and after (other work on the machine inflates wall time)
  local name=$1; shift
  echo "== $name: $*" >&2
  cut -d' ' -f1-3 /proc/loadavg > "$D/$name.load"
  /usr/bin/time -v "$@" > "$D/$name.out" 2> "$D/$name.time"
  cut -d' ' -f1-3 /proc/loadavg >> "$D/$name.load"
}

rm -rf "$D/mflow-out" "$D/mflow-nomemo-out" "$D/python.bin" "$D/python.idx" "$D/mflow-nomemo.time"
# (a) the crate's default path; (a') mflow's encode path (word memo + lean splitter), both without I/O
measure ceiling "$EX/encode-ceiling" "$D/corpus.jsonl" "$D/tokenizer/tokenizer.json" "$THREADS" default
measure ceiling-memo "$EX/encode-ceiling" "$D/corpus.jsonl" "$D/tokenizer/tokenizer.json" "$THREADS" memo
measure mflow "$EX/mflow-dataset" "$D/corpus.jsonl" --tokenizer "$D/tokenizer" --out "$D/mflow-out" \
  --threads "$THREADS" --splits 100,0,0
RAYON_NUM_THREADS=$THREADS measure python "$PY" "$HERE/python_pipeline.py" "$D/corpus.jsonl" \
  "$D/tokenizer/tokenizer.json" "$D/python"

# the two pipelines must have written the same dataset
cmp "$D/python.bin" "$D/mflow-out/train.bin"
cmp "$D/python.idx" "$D/mflow-out/train.idx"
echo "python and mflow outputs are byte-identical" >&2
# mflow without the word memo (the crate's encode_fast per document), for the before/after ratio
if [ "${SKIP_NOMEMO:-0}" != 1 ]; then
  measure mflow-nomemo "$EX/mflow-dataset" "$D/corpus.jsonl" --tokenizer "$D/tokenizer" --out "$D/mflow-nomemo-out" \
    --threads "$THREADS" --splits 100,0,0 --word-memo-mib 0
  cmp "$D/python.bin" "$D/mflow-nomemo-out/train.bin"
fi
"$PY" "$HERE/report.py" "$D"
