#!/usr/bin/env bash
# Runs the fuzz targets side by side, each with its own fork workers, and keeps their corpora.
#
#   bash fuzz/run.sh BIN_DIR CORPUS_DIR OUT_DIR SECONDS [TARGET=WORKERS[:MAX_LEN] ...]
#
# BIN_DIR holds the targets built by `cargo +nightly fuzz build -O` (stripped copies will do);
# CORPUS_DIR/TARGET is each target's corpus, grown in place and copied to OUT_DIR/corpus;
# OUT_DIR/TARGET.log is libFuzzer's output, and OUT_DIR/summary.tsv a line per target.
set -euo pipefail
bin=$1 corpus=$2 out=$3 seconds=$4
shift 4
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(spec=6 safetensors_header=2 hf_config=2 manifest=2 tokenizer_config=2 pretokenizer=2:4096)
mkdir -p "$out/artifacts"
pids=()
for t in "${targets[@]}"; do
  name=${t%%=*} workers=${t#*=} len=65536
  # Texts for the pre-tokenizer stay short: it runs three tokenizers' pre-tokenizers twice, and
  # what it can get wrong shows in a few characters.
  case $workers in *:*) len=${workers#*:} workers=${workers%%:*} ;; esac
  mkdir -p "$corpus/$name" "$out/artifacts/$name"
  "$bin/$name" "$corpus/$name" -max_total_time="$seconds" -rss_limit_mb=2048 -max_len="$len" -timeout=10 \
    -fork="$workers" -ignore_crashes=1 -print_final_stats=1 -artifact_prefix="$out/artifacts/$name/" \
    >"$out/$name.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || true; done
printf 'target\texecutions\tseconds\tcoverage\tfeatures\tcorpus\tcrashes\tooms\ttimeouts\n' >"$out/summary.tsv"
for t in "${targets[@]}"; do
  name=${t%%=*}
  # Fork mode's status lines: "#N: cov: C ft: F corp: K exec/s: E oom/timeout/crash: O/T/X time: S job: J".
  line=$(grep -E '^#[0-9]+: cov:' "$out/$name.log" | tail -1 || true)
  read -r execs cov ft corp ooms timeouts crashes secs < <(echo "$line" | sed -E \
    's/^#([0-9]+): cov: ([0-9]+) ft: ([0-9]+) corp: ([0-9]+).* oom\/timeout\/crash: ([0-9]+)\/([0-9]+)\/([0-9]+) time: ([0-9]+)s.*/\1 \2 \3 \4 \5 \6 \7 \8/')
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$execs" "$secs" "$cov" "$ft" "$corp" "$crashes" "$ooms" "$timeouts" >>"$out/summary.tsv"
done
cp -r "$corpus" "$out/corpus"
cat "$out/summary.tsv"
