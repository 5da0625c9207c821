#!/usr/bin/env bash
# mflow's end-to-end suite on a real control plane: checks the suite's shell with shellcheck,
# builds (or reuses) the cluster's binaries and the cases (the Rust tests of package mflow-e2e,
# tests/e2e/kubernetes/cases), brings the cluster up with kwok and runs the kwok cases through
# the `mflow` binary, brings it down, then does the same with a real kubelet. nextest prints a
# line per case; the suite ends with "N passed, N failed" and exits non-zero when one failed.
#
#   tests/e2e/kubernetes/run.sh [CASE...]     (default: every case; names as the tests' own,
#                                              without their module: sigint_cancels)
#
# MFLOW_BIN names the mflow binary (default: target/debug/mflow, as the test build leaves it).
set -euo pipefail

# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MFLOW_BIN="${MFLOW_BIN:-$REPO_ROOT/target/debug/mflow}"
[ -x "$MFLOW_BIN" ] || die "no mflow binary at $MFLOW_BIN (build it, or set MFLOW_BIN)"
MFLOW_BIN="$(cd "$(dirname "$MFLOW_BIN")" && pwd)/$(basename "$MFLOW_BIN")"
# The mflow home whose Python environment was provisioned before the suite: the local run that
# main_job_on_kubelet compares the cluster's with uses it. The cases give mflow a home of their own.
MFLOW_E2E_LOCAL_HOME="${MFLOW_E2E_LOCAL_HOME:-${MFLOW_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/mflow}}"
# The mflow wheel notebook_on_kubelet installs: the newest of target/wheels/ unless given.
if [ -z "${MFLOW_E2E_WHEEL:-}" ]; then
  # No wheels directory is no wheel (find fails on it): the case that needs one says so.
  MFLOW_E2E_WHEEL=$({ find "${CARGO_TARGET_DIR:-$REPO_ROOT/target}/wheels" -name 'mflow-*.whl' -printf '%T@ %p\n' 2>/dev/null || true; } |
    sort -n | tail -1 | cut -d' ' -f2-)
fi
export MFLOW_BIN MFLOW_E2E_LOCAL_HOME MFLOW_E2E_WHEEL MFLOW_E2E_STATE="$STATE_DIR"

VOLUME=/mflow
TARGET_DIR="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"
RESULTS="$STATE_DIR.results"
rm -rf "$RESULTS"
mkdir -p "$RESULTS"

passed=0
failed=0
failures=()
t0=$SECONDS

log "== shellcheck"
if (cd "$E2E_DIR" && shellcheck -x ./*.sh); then
  passed=$((passed + 1))
  echo "PASS shellcheck of tests/e2e/kubernetes/*.sh"
else
  failed=$((failed + 1))
  failures+=(shellcheck)
  echo "FAIL shellcheck of tests/e2e/kubernetes/*.sh"
fi

log "== building or reusing the cluster's binaries"
bash "$E2E_DIR/build.sh"
log "== binaries ready in $((SECONDS - t0))s"

# The cases are built with the workspace's test build (`cargo nextest run --workspace --no-run`:
# one feature set, so that nothing compiles twice); `--workspace` keeps that set here too.
cd "$REPO_ROOT"
NEXTEST=(cargo nextest run --workspace --profile e2e --run-ignored only --no-fail-fast --cargo-quiet)
log "== the cases (package mflow-e2e)"
mapfile -t ALL < <(cargo nextest list --workspace --run-ignored only --cargo-quiet --message-format oneline \
  -E 'package(mflow-e2e) & test(/^(kwok|kubelet)::/)' | awk '{print $2}')
[ ${#ALL[@]} -gt 0 ] || die "no cases in package mflow-e2e"

WANTED=("$@")
for name in "${WANTED[@]}"; do
  printf '%s\n' "${ALL[@]}" | grep -qxE "(kwok|kubelet)::$name" ||
    die "no case $name; the cases: $(printf '%s\n' "${ALL[@]}" | sed 's/^.*:://' | tr '\n' ' ')"
done

# cases_of MODE: the cases of MODE to run (all, or those named on the command line).
cases_of() {
  local test name
  for test in "${ALL[@]}"; do
    case $test in "$1"::*) ;; *) continue ;; esac
    if [ ${#WANTED[@]} -eq 0 ]; then
      echo "$test"
      continue
    fi
    for name in "${WANTED[@]}"; do
      [ "$test" != "$1::$name" ] || echo "$test"
    done
  done
}

# The stage image and the images of docker/Dockerfile for the kubelet's pods, and /mflow: the
# artifact volume where mflow and its pods see it (a link to the hostPath behind the claim).
setup_phase() {
  if [ -e "$VOLUME" ] || [ -L "$VOLUME" ]; then
    [ "$(readlink "$VOLUME" || true)" = "$STATE_DIR/artifacts" ] || die "$VOLUME exists and is not this suite's; move it away first"
  fi
  ln -sfn "$STATE_DIR/artifacts" "$VOLUME"
  [ "$1" = kubelet ] || return 0
  # busybox and this mflow (stripped: the debug build's line tables are most of its size).
  local lean="$STATE_DIR/mflow" images
  cp "$MFLOW_BIN" "$lean"
  strip "$lean" 2>/dev/null || true
  bash "$E2E_DIR/image.sh" mflow-e2e/mflow:dev "$lean" >"$STATE_DIR/image.log" 2>&1 || { cat "$STATE_DIR/image.log"; return 1; }
  # cpu-train and cpu with this mflow, built or reused, and imported: MFLOW_E2E_TRAIN_IMAGE and
  # MFLOW_E2E_CPU_IMAGE name them.
  images=$(bash "$E2E_DIR/images.sh") || { echo "cannot build the images of docker/Dockerfile (images.sh)"; return 1; }
  eval "$(grep -E '^MFLOW_E2E_(TRAIN|CPU)_IMAGE=[a-z0-9./:_-]+$' <<<"$images" | sed 's/^/export /')"
}

teardown_phase() {
  [ "$(readlink "$VOLUME" 2>/dev/null || true)" = "$STATE_DIR/artifacts" ] && rm -f "$VOLUME"
  return 0
}

# count FILE: adds the passed and failed cases of a JUnit report of nextest.
count() {
  local head tests nfail nerr
  head=$(grep -o '<testsuites [^>]*>' "$1" | head -n 1)
  tests=$(sed -n 's/.* tests="\([0-9]*\)".*/\1/p' <<<"$head")
  nfail=$(sed -n 's/.* failures="\([0-9]*\)".*/\1/p' <<<"$head")
  nerr=$(sed -n 's/.* errors="\([0-9]*\)".*/\1/p' <<<"$head")
  passed=$((passed + tests - nfail - nerr))
  failed=$((failed + nfail + nerr))
  mapfile -t -O "${#failures[@]}" failures < <(awk '
    match($0, /<testcase name="[^"]*"/) { name = substr($0, RSTART + 16, RLENGTH - 17) }
    /<(failure|error)[ >]/ { print name }' "$1")
}

phase() {
  local mode=$1 cases filter t=$SECONDS
  mapfile -t cases < <(cases_of "$mode")
  [ ${#cases[@]} -gt 0 ] || return 0
  if [ ${#WANTED[@]} -eq 0 ]; then
    filter="package(mflow-e2e) & test(/^$mode::/)"
  else
    filter="package(mflow-e2e) & ($(printf 'test(=%s) | ' "${cases[@]}" | sed 's/ | $//'))"
  fi
  log "== cluster up ($mode)"
  if ! bash "$E2E_DIR/cluster.sh" up "$mode" || ! setup_phase "$mode"; then
    local name
    for name in "${cases[@]}"; do
      failed=$((failed + 1))
      failures+=("$name")
      printf 'FAIL %s (the %s cluster did not come up)\n' "$name" "$mode"
    done
    teardown_phase
    bash "$E2E_DIR/cluster.sh" down || true
    return 0
  fi
  log "== cluster up in $((SECONDS - t))s"
  local junit="$TARGET_DIR/nextest/e2e/junit.xml"
  rm -f "$junit"
  "${NEXTEST[@]}" -E "$filter" || true
  if [ -f "$junit" ]; then
    cp "$junit" "$RESULTS/junit-$mode.xml"
    count "$junit"
  else
    failed=$((failed + ${#cases[@]}))
    failures+=("${cases[@]}")
    echo "FAIL the $mode cases: nextest wrote no report"
  fi
  teardown_phase
  bash "$E2E_DIR/cluster.sh" down
}

trap 'teardown_phase >/dev/null 2>&1 || true; bash "$E2E_DIR/cluster.sh" down >/dev/null 2>&1 || true' EXIT

phase kwok
phase kubelet

log "== suite done in $((SECONDS - t0))s"
[ ${#failures[@]} -eq 0 ] || log "failed: ${failures[*]} (JUnit reports in $RESULTS)"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
