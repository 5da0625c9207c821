#!/usr/bin/env bash
# Engine overhead: mflow against a plain shell script, make, ninja, Snakemake and DVC on four
# synthetic DAGs (chain of 100, fan 1 -> 500 -> 1, random DAG of 1000, binary tree of 1023; the same
# kinds at about 5,000 stages with SHAPES="chain5k fan5k random5k tree5k"). See docs/benchmarks.md.
#
# usage: benches/engine/run.sh WORK_DIR
# environment: MFLOW (default: target/release/mflow), SNAKEMAKE, DVC (executables; the engine is
# left out when unset), SHAPES, REPS, NOOP_REPS, SLOW_COLD_REPS, DVC_TIMEOUT (see measure.py).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="${1:?usage: run.sh WORK_DIR}"
mkdir -p "$work"
export MFLOW="${MFLOW:-$here/../../target/release/mflow}"
[ -x "$MFLOW" ] || { echo "mflow binary not found at $MFLOW (build with cargo build --release, or set MFLOW)" >&2; exit 2; }
command -v ninja >/dev/null || { echo "ninja not found (apt-get install ninja-build)" >&2; exit 2; }
echo "# $(date -u +%FT%TZ) $(nproc) CPUs, load: $(cut -d' ' -f1-3 /proc/loadavg)"
"$MFLOW" --version 2>/dev/null | head -1 || true
make --version | head -1; echo "ninja $(ninja --version)"
if [ -n "${SNAKEMAKE:-}" ]; then echo "snakemake $("$SNAKEMAKE" --version)"; fi
if [ -n "${DVC:-}" ]; then echo "dvc $("$DVC" --version)"; fi
python3 "$here/measure.py" "$work" "$work/results.json"
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 "$here/report.py" "$work/results.json"
