#!/usr/bin/env bash
# Smoke check of a running e2e cluster with kubectl alone (no mflow): TrainJobs through the
# real Trainer and JobSet controllers and webhooks.
#
#   smoke.sh          checks for the mode the cluster was started in (cluster.sh up MODE)
#
# kwok:    a TrainJob on mflow-cpu-hostnet completes; ones marked to fail (label, and env as
#          mflow would pass it) end Failed; one that sets PET_NNODES is refused by Trainer's
#          webhook; kubectl logs reaches kwok's server.
# kubelet: a TrainJob with the artifact claim mounted writes /mflow/x, which then exists in
#          the hostPath directory; kubectl logs reaches the kubelet.
set -euo pipefail

# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

[ -f "$STATE_DIR/env" ] || die "no cluster in $STATE_DIR; run cluster.sh up first"
# shellcheck disable=SC1091
. "$STATE_DIR/env"
NS=$MFLOW_E2E_NAMESPACE
k() { kubectl -n "$NS" "$@"; }
start=$SECONDS

ok() { log "ok: $*"; }
bad() {
  printf 'FAIL: %s\n' "$*" >&2
  k get trainjobs,jobsets,jobs,pods -o wide >&2 || true
  exit 1
}

# trainjob NAME [POD_LABELS_JSON [ENV_JSON [COMMAND_JSON [POD_SPEC_PATCH_JSON [CONTAINER_PATCH_JSON]]]]]
trainjob() {
  local name=$1 labels=${2:-'{}'} env=${3:-'[]'} cmd=${4:-'["sh","-c","true"]'}
  local pod_spec=${5:-'{}'} container=${6:-'{}'}
  jq -n --arg name "$name" --argjson labels "$labels" --argjson env "$env" --argjson cmd "$cmd" \
    --argjson podspec "$pod_spec" --argjson container "$container" --arg image "$IMAGE" '{
    apiVersion: "trainer.kubeflow.org/v1alpha1", kind: "TrainJob",
    metadata: {name: $name, labels: {"mflow-e2e/smoke": "true"}},
    spec: {
      runtimeRef: {name: "mflow-cpu-hostnet"},
      trainer: {image: $image, command: $cmd[:1], args: $cmd[1:], env: $env, numNodes: 1, numProcPerNode: 1},
      runtimePatches: [{
        manager: "mflow.dev/e2e-smoke",
        trainingRuntimeSpec: {template: {spec: {replicatedJobs: [{
          name: "node",
          template: {spec: {template: {
            metadata: {labels: $labels},
            spec: ($podspec + {containers: [{name: "node"} + $container]})
          }}}
        }]}}}
      }]
    }
  }'
}

wait_condition() { # NAME CONDITION SECONDS
  k wait --for=condition="$2" "trainjob/$1" --timeout="${3}s" >/dev/null ||
    bad "TrainJob $1 did not reach $2 within ${3}s"
  ok "TrainJob $1 is $2"
}

pod_of() { k get pods -l "jobset.sigs.k8s.io/jobset-name=$1" -o jsonpath='{.items[0].metadata.name}'; }

cleanup() { k delete trainjobs -l mflow-e2e/smoke=true --ignore-not-found --wait=true >/dev/null 2>&1 || true; }

smoke_kwok() {
  IMAGE=mflow-e2e/none:1
  cleanup
  trainjob smoke-ok | k create -f - >/dev/null
  trainjob smoke-fail-label '{"mflow-e2e/fail":"always"}' | k create -f - >/dev/null
  trainjob smoke-fail-env '{}' '[{"name":"MFLOW_E2E_FAIL","value":"always"}]' | k create -f - >/dev/null
  # Attempt 2 of a stage that fails only on attempt 1.
  trainjob smoke-first-a2 '{"mflow-e2e/fail":"first","mflow.dev/attempt":"2"}' | k create -f - >/dev/null
  wait_condition smoke-ok Complete 60
  wait_condition smoke-fail-label Failed 60
  wait_condition smoke-fail-env Failed 60
  wait_condition smoke-first-a2 Complete 60

  local out
  if out=$(trainjob smoke-reserved '{}' '[{"name":"PET_NNODES","value":"2"}]' | k create -f - 2>&1); then
    bad "a TrainJob setting PET_NNODES was accepted"
  fi
  case $out in
    *'validator.trainjob.trainer.kubeflow.org'*PET_NNODES*) ok "PET_NNODES refused: $out" ;;
    *) bad "PET_NNODES refused for another reason: $out" ;;
  esac

  local pod
  pod=$(pod_of smoke-ok)
  out=$(k logs "$pod" -c node) || bad "kubectl logs $pod failed"
  case $out in *"served by kwok"*) ok "kubectl logs $pod: $out" ;; *) bad "unexpected logs of $pod: $out" ;; esac
}

smoke_kubelet() {
  IMAGE=mflow-e2e/smoke:1
  "$E2E_DIR/image.sh" "$IMAGE" >/dev/null
  cleanup
  rm -f "$MFLOW_E2E_ARTIFACTS/x"
  # The claim goes in as mflow mounts it: volume mflow-artifacts at /mflow in container node.
  trainjob smoke-pvc '{}' '[]' '["sh","-c","echo hello > /mflow/x && echo smoke: wrote /mflow/x"]' \
    '{"volumes":[{"name":"mflow-artifacts","persistentVolumeClaim":{"claimName":"mflow-artifacts"}}]}' \
    '{"volumeMounts":[{"name":"mflow-artifacts","mountPath":"/mflow"}]}' | k create -f - >/dev/null
  wait_condition smoke-pvc Complete 120
  [ "$(cat "$MFLOW_E2E_ARTIFACTS/x" 2>/dev/null)" = hello ] || bad "$MFLOW_E2E_ARTIFACTS/x does not hold hello"
  ok "$MFLOW_E2E_ARTIFACTS/x holds hello"
  local pod out
  pod=$(pod_of smoke-pvc)
  out=$(k logs "$pod" -c node) || bad "kubectl logs $pod failed"
  case $out in *"smoke: wrote /mflow/x"*) ok "kubectl logs $pod: $out" ;; *) bad "unexpected logs of $pod: $out" ;; esac
}

case $MFLOW_E2E_MODE in
  kwok) smoke_kwok ;;
  kubelet) smoke_kubelet ;;
  *) die "unknown mode $MFLOW_E2E_MODE" ;;
esac
cleanup
log "smoke ($MFLOW_E2E_MODE) passed in $((SECONDS - start))s"
