#!/usr/bin/env bash
# Checkpoint conversion benchmark: `mflow convert --tp 2` against `cp -r` of the same checkpoint
# (the I/O floor) and against the straightforward Python conversion (baseline.py), side by side,
# each started with a cold page cache (or a warm one where caches cannot be dropped).
#
# Usage: benches/convert/run.sh WORK_DIR [1b|8b|all]     (needs MFLOW_PYTHON with torch+safetensors)
set -euo pipefail
WORK=${1:?usage: run.sh WORK_DIR [1b|8b|all]}
WHICH=${2:-all}
PY=${MFLOW_PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
mkdir -p "$WORK"

# MFLOW_CKPT_BIN: a prebuilt binary with the same commands (mflow or mflow-ckpt), for machines without cargo.
if [ -n "${MFLOW_CKPT_BIN:-}" ]; then BIN=$MFLOW_CKPT_BIN; else
  (cd "$ROOT" && cargo build --quiet --release -p mflow-ckpt --example mflow-ckpt)
  BIN=$TARGET/release/examples/mflow-ckpt
fi
TIME=${TIME_BIN:-/usr/bin/time}
df -h "$WORK" | tail -1

# On tmpfs the data is memory whatever the cache state: nothing to drop or flush, and a global sync
# would only time other processes' disk writes.
TMPFS=$([ "$(stat -f -c %T "$WORK")" = tmpfs ] && echo 1 || echo 0)
SYNC=$([ "$TMPFS" = 1 ] && echo true || echo sync)
CACHE=""
cache() {
  if [ "$TMPFS" = 1 ]; then CACHE=tmpfs; return; fi
  sync
  if echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; then CACHE=cold; else cat "$1"/*.safetensors > /dev/null; CACHE=warm; fi
}

# measure LABEL SRC_BYTES CMD...: prints a row and sets SECS.
measure() {
  local label=$1 bytes=$2; shift 2
  cache "$SRC"
  "$TIME" -v -o "$WORK/time.txt" bash -c "$* && $SYNC"
  local wall rss load
  load=$(cut -d' ' -f1 /proc/loadavg)  # 1-minute load just after the run: others' work on the machine
  wall=$(grep "Elapsed (wall clock)" "$WORK/time.txt" | awk '{print $NF}')
  SECS=$(echo "$wall" | awk -F: '{ if (NF==3) print $1*3600+$2*60+$3; else print $1*60+$2 }')
  rss=$(grep "Maximum resident set size" "$WORK/time.txt" | awk '{print $NF}')
  # CPU seconds (user + system) are much less sensitive than wall time to others' load.
  CPU=$(awk -F': ' '/User time|System time/ {s += $2} END {printf "%.2f", s}' "$WORK/time.txt")
  printf "| %-28s | %8.2f s | %6.2f s | %6.2f GB/s | %8.0f MB | %s | %s |\n" "$label" "$SECS" "$CPU" "$(calc "$bytes / $SECS / 1000000000")" "$(calc "$rss / 1024")" "$CACHE" "$load"
}

calc() { awk "BEGIN { printf \"%.4f\", $1 }"; }

median() { printf "%s\n" "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

# bench NAME REPS: the three runs side by side, REPS rounds, ratios of the medians.
bench() {
  local name=$1 reps=$2
  SRC=$WORK/$name-hf
  local bytes
  bytes=$(cat "$SRC"/*.safetensors | wc -c)
  echo "## $name: $(calc "$bytes / 1000000000" | cut -c1-5) GB of safetensors, $reps round(s)"
  echo "| run | wall | CPU | throughput | peak RSS | page cache | load avg |"
  echo "|---|---|---|---|---|---|---|"
  local cps=() mfs=() pys=() cpc=() mfc=() pyc=() d1 d2=""
  for _ in $(seq "$reps"); do
    rm -rf "$WORK/$name-cp" "$WORK/$name-mflow" "$WORK/$name-py"
    measure "cp -r" "$bytes" cp -r "$SRC" "$WORK/$name-cp"; cps+=("$SECS"); cpc+=("$CPU")
    rm -rf "$WORK/$name-cp"
    measure "mflow convert --tp 2" "$bytes" "$BIN" convert "$SRC" "$WORK/$name-mflow" --tp 2; mfs+=("$SECS"); mfc+=("$CPU")
    d1=$("$PY" "$HERE/digest.py" "$WORK/$name-mflow")
    rm -rf "$WORK/$name-mflow"
    # The baseline holds a whole rank in memory (twice, while save_file serializes it).
    local need=$((bytes * 13 / 10))
    local avail=$(( $(awk '/MemAvailable/ {print $2}' /proc/meminfo) * 1024 ))
    if [ "$avail" -lt "$need" ]; then
      echo "| python baseline.py (tp 2)    | skipped: needs ~$((need >> 30)) GiB of RAM, $((avail >> 30)) GiB available | | | |"
      continue
    fi
    measure "python baseline.py (tp 2)" "$bytes" "$PY" "$HERE/baseline.py" "$SRC" "$WORK/$name-py" 2; pys+=("$SECS"); pyc+=("$CPU")
    d2=$("$PY" "$HERE/digest.py" "$WORK/$name-py")
    rm -rf "$WORK/$name-py"
    if [ "$d1" != "$d2" ]; then echo "OUTPUTS DIFFER: $d1 vs $d2"; exit 1; fi
  done
  local cp mf
  cp=$(median "${cps[@]}"); mf=$(median "${mfs[@]}")
  echo
  echo "medians: cp -r $cp s, mflow $mf s$([ ${#pys[@]} -gt 0 ] && echo ", python $(median "${pys[@]}") s")"
  echo "mflow / cp -r = $(calc "$mf / $cp" | cut -c1-4)x$([ ${#pys[@]} -gt 0 ] && echo "; python / mflow = $(calc "$(median "${pys[@]}") / $mf" | cut -c1-4)x")"
  echo "CPU medians: cp -r $(median "${cpc[@]}") s, mflow $(median "${mfc[@]}") s$([ ${#pyc[@]} -gt 0 ] && echo ", python $(median "${pyc[@]}") s; python / mflow = $(calc "$(median "${pyc[@]}") / $(median "${mfc[@]}")" | cut -c1-4)x")"
  if [ -n "$d2" ]; then echo "mflow and python outputs identical (tensor digest $d1)"; fi
  echo
}

if [ "$WHICH" = 1b ] || [ "$WHICH" = all ]; then
  [ -d "$WORK/llama-1b-hf" ] || "$TIME" -f "generated llama-1b in %e s" "$BIN" model init:llama-1b "$WORK/llama-1b-hf"
  bench llama-1b "${REPS_1B:-3}"
fi
if [ "$WHICH" = 8b ] || [ "$WHICH" = all ]; then
  [ -d "$WORK/llama-8b-hf" ] || "$PY" "$HERE/synth8b.py" "$WORK/llama-8b-hf"
  bench llama-8b "${REPS_8B:-1}"
  rm -rf "$WORK/llama-8b-hf"
fi
