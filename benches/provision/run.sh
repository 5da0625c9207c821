#!/usr/bin/env bash
# benches/provision/run.sh WORK_DIR: the first run's Python environment (workloads/requirements.lock,
# torch and its CUDA libraries included), provisioned by uv and by pip, each with cold and with
# warm package caches, side by side in one invocation.
#
# Each measurement is `mflow env` (it provisions, then prints the interpreter) with a fresh
# MFLOW_HOME, so the environment and mflow's uv are made from nothing; cold: empty package caches
# (UV_CACHE_DIR, PIP_CACHE_DIR), warm: the caches the cold run of the same installer filled. The
# environment is then checked (torch and transformers import). One installer at a time, its
# files removed after it: both at once would hold ~20 GB.
#
#   MFLOW=target/release/mflow benches/provision/run.sh /tmp/provision
set -euo pipefail
work=${1:?usage: benches/provision/run.sh WORK_DIR}
mflow=$(realpath "${MFLOW:-target/release/mflow}")
mkdir -p "$work"
work=$(realpath "$work")
results="$work/results.tsv"
printf 'installer\tcaches\tseconds\tenvironment\tload\n' >"$results"

# measure INSTALLER CACHES: one provisioning from nothing but the caches.
measure() {
  local installer=$1 caches=$2 home="$work/home-$1-$2" t0 t1 python
  rm -rf "$home"
  t0=$(date +%s.%N)
  python=$(env -u PIP_NO_CACHE_DIR MFLOW_HOME="$home" MFLOW_INSTALLER="$installer" \
    UV_CACHE_DIR="$work/uv-cache" PIP_CACHE_DIR="$work/pip-cache" "$mflow" env 2>"$work/$installer-$caches.log")
  t1=$(date +%s.%N)
  "$python" -W ignore -c 'import torch, transformers, megatron.core' || { echo "$installer $caches: the environment does not import" >&2; exit 1; }
  grep -q "with $installer" "$work/$installer-$caches.log" || { echo "$installer $caches: not provisioned by $installer" >&2; exit 1; }
  printf '%s\t%s\t%.1f\t%s\t%s\n' "$installer" "$caches" "$(awk "BEGIN { print $t1 - $t0 }")" \
    "$(du -sh --apparent-size "$home/python" | cut -f1)" "$(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$results"
  rm -rf "$home"
}

for installer in uv pip; do
  rm -rf "$work/uv-cache" "$work/pip-cache"
  measure "$installer" cold
  measure "$installer" warm
  rm -rf "$work/uv-cache" "$work/pip-cache"
done
column -t -s $'\t' "$results"
