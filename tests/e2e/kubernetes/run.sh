#!/usr/bin/env bash
# mflow's end-to-end suite on a real control plane: builds (or reuses) the cluster's binaries,
# brings the cluster up with kwok, runs the kwok cases through the `mflow` binary, brings it
# down, then does the same with a real kubelet. Prints one line per case and ends with
# "N passed, N failed"; exits non-zero when a case failed.
#
#   tests/e2e/kubernetes/run.sh [CASE...]     (default: every case; names as in cases.sh)
#
# MFLOW_BIN names the mflow binary (default: target/debug/mflow, as the test build leaves it).
set -euo pipefail

# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=cases.sh
. "$E2E_DIR/cases.sh"

MFLOW_BIN="${MFLOW_BIN:-$REPO_ROOT/target/debug/mflow}"
[ -x "$MFLOW_BIN" ] || die "no mflow binary at $MFLOW_BIN (build it, or set MFLOW_BIN)"
MFLOW_BIN="$(cd "$(dirname "$MFLOW_BIN")" && pwd)/$(basename "$MFLOW_BIN")"
export MFLOW_BIN

t0=$SECONDS
log "== building or reusing the cluster's binaries"
bash "$E2E_DIR/build.sh"
log "== binaries ready in $((SECONDS - t0))s"

wanted=("$@")
selected() {
  [ ${#wanted[@]} -eq 0 ] && return 0
  local w
  for w in "${wanted[@]}"; do [ "$w" = "$1" ] && return 0; done
  return 1
}

passed=0
failed=0
failures=()
RESULTS="$STATE_DIR.results"
rm -rf "$RESULTS"
mkdir -p "$RESULTS"

run_case() {
  local name=$1 t=$SECONDS
  if bash "$E2E_DIR/case.sh" "$name" >"$RESULTS/$name.log" 2>&1; then
    passed=$((passed + 1))
    printf 'PASS %-34s %4ss\n' "$name" $((SECONDS - t))
  else
    failed=$((failed + 1))
    failures+=("$name")
    printf 'FAIL %-34s %4ss\n' "$name" $((SECONDS - t))
    sed 's/^/    | /' "$RESULTS/$name.log" | tail -n 60
  fi
}

phase() {
  local mode=$1 name
  shift
  local cases=()
  for name in "$@"; do selected "$name" && cases+=("$name"); done
  [ ${#cases[@]} -gt 0 ] || return 0
  log "== cluster up ($mode)"
  local t=$SECONDS
  if ! bash "$E2E_DIR/cluster.sh" up "$mode"; then
    for name in "${cases[@]}"; do
      failed=$((failed + 1))
      failures+=("$name")
      printf 'FAIL %-34s (the %s cluster did not come up)\n' "$name" "$mode"
    done
    bash "$E2E_DIR/cluster.sh" down || true
    return 0
  fi
  log "== cluster up in $((SECONDS - t))s"
  eval "$(bash "$E2E_DIR/cluster.sh" env)"
  setup_phase "$mode"
  for name in "${cases[@]}"; do run_case "$name"; done
  teardown_phase
  bash "$E2E_DIR/cluster.sh" down
}

trap 'teardown_phase >/dev/null 2>&1 || true; bash "$E2E_DIR/cluster.sh" down >/dev/null 2>&1 || true' EXIT

phase kwok "${KWOK_CASES[@]}"
phase kubelet "${KUBELET_CASES[@]}"

log "== suite done in $((SECONDS - t0))s"
[ ${#failures[@]} -eq 0 ] || log "failed: ${failures[*]} (logs in $RESULTS)"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
