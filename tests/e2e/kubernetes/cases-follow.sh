# shellcheck shell=bash
# Cases of run.sh (following a stage on a real cluster: disruptions, broken log streams, node and suspend states, and many nodes).
# Sourced by cases.sh; each case_NAME follows its conventions.

KWOK_CASES+=(pod_deleted_on_kwok_says_so many_nodes_kwok)
KUBELET_CASES+=(stage_pod_deleted_is_infra log_stream_survives_apiserver_restart)

# The pod of a stage of a case, once it runs.
stage_pod() { kc get pods -l "mflow.dev/pipeline=$(pipeline_of "$1"),mflow.dev/stage=$2" --field-selector=status.phase=Running -o name | head -n 1 | grep .; }

# Lines of mflow's own that a display must never show: raw library logging.
no_raw_logging() {
  not_contains "$1" "ERROR kube_client"
  not_contains "$1" "WARN kube_client"
  not_contains "$1" "WARN mflow_kube"
  not_contains "$1" "ERROR mflow_kube"
}

# A stage pod deleted while its container runs (kubectl delete pod, as a drain without
# eviction does), and one evicted through the Eviction API: each attempt is a disruption,
# class infra, said as such, and the stage's infra retry runs it again to success.
case_stage_pod_deleted_is_infra() {
  local c=stage_pod_deleted_is_infra spec pid code=0 pod out
  spec=$(write_spec $c <<'EOF'
[stages.deleted]
kind = "command"
retries = { max = 1, backoff = "1s", on = ["infra"] }
run = ["sh", "-c", "echo attempt $MFLOW_ATTEMPT; if [ $MFLOW_ATTEMPT = 1 ]; then sleep 600; fi; echo ok > $MFLOW_OUTPUT/x"]

[stages.evicted]
kind = "command"
needs = ["deleted"]
retries = { max = 1, backoff = "1s", on = ["infra"] }
run = ["sh", "-c", "echo attempt $MFLOW_ATTEMPT; if [ $MFLOW_ATTEMPT = 1 ]; then sleep 600; fi; echo ok > $MFLOW_OUTPUT/x"]
EOF
)
  local t0=$SECONDS
  "$MFLOW_BIN" run "$spec" >"$STATE_DIR/$c.out" 2>&1 &
  pid=$!
  wait_until 120 stage_pod $c deleted
  wait_until 60 grep -q "deleted | \[rank 0\] attempt 1" "$STATE_DIR/$c.out"
  pod=$(stage_pod $c deleted)
  kc delete "$pod" --grace-period=5 --wait=false
  wait_until 180 stage_pod $c evicted
  wait_until 60 grep -q "evicted | \[rank 0\] attempt 1" "$STATE_DIR/$c.out"
  pod=$(stage_pod $c evicted)
  kc create --raw "/api/v1/namespaces/$NS/pods/${pod#pod/}/eviction" -f - <<EOF
{"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "${pod#pod/}", "namespace": "$NS"}, "deleteOptions": {"gracePeriodSeconds": 5}}
EOF
  wait "$pid" || code=$?
  out=$(cat "$STATE_DIR/$c.out")
  echo "$out"
  echo "mflow ran ${SECONDS}s after its start at ${t0}s"
  eq "$code" 0 "exit code"
  local rec
  rec=$(record $c)
  eq "$(jq -r '[.stages.deleted.attempts[].outcome] | join(",")' <<<"$rec")" "infra,success" "attempts of the deleted stage"
  eq "$(jq -r '[.stages.evicted.attempts[].outcome] | join(",")' <<<"$rec")" "infra,success" "attempts of the evicted stage"
  contains "$(jq -r '.stages.deleted.attempts[0].message' <<<"$rec")" "rank 0: pod "
  contains "$(jq -r '.stages.deleted.attempts[0].message' <<<"$rec")" "was deleted while its container ran (it then exited with code 137 (SIGKILL))"
  contains "$(jq -r '.stages.evicted.attempts[0].message' <<<"$rec")" "was evicted (Eviction API)"
  contains "$out" "was deleted while its container ran"
  not_contains "$out" "user failures are not retried"
  no_raw_logging "$out"
  eq "$(jq -r .status <<<"$rec")" succeeded
  eq "$(trainjobs $c)" 4 "TrainJobs (two attempts of each stage)"
}

# On kwok a deleted pod goes at once, its container never reported as ended: still a
# disruption, and the message says that the pod was deleted.
case_pod_deleted_on_kwok_says_so() {
  local c=pod_deleted_on_kwok_says_so spec pid code=0 out
  spec=$(write_spec $c <<'EOF'
[stages.slow]
kind = "command"
env = { MFLOW_E2E_DURATION = "120s" }
run = ["sh", "-c", "true"]
EOF
)
  "$MFLOW_BIN" run "$spec" >"$STATE_DIR/$c.out" 2>&1 &
  pid=$!
  wait_until 60 stage_pod $c slow
  kc delete "$(stage_pod $c slow)" --wait=false
  wait "$pid" || code=$?
  out=$(cat "$STATE_DIR/$c.out")
  echo "$out"
  eq "$code" 3 "exit code of an infra failure"
  eq "$(record $c | jq -r '[.stages.slow.attempts[].outcome] | join(",")')" infra
  contains "$(record $c | jq -r .stages.slow.message)" "infra: rank 0: pod "
  contains "$(record $c | jq -r .stages.slow.message)" "was deleted while its container ran"
  contains "$out" "was deleted while its container ran"
}

# The API server is stopped and started again in the middle of a stage: the display says once
# that it is unreachable and once that it is back, with no raw library lines, and the attempt
# log and `mflow logs` hold every line the container printed, each once.
case_log_stream_survives_apiserver_restart() {
  local c=log_stream_survives_apiserver_restart spec pid code=0 out log want
  spec=$(write_spec $c <<'EOF'
[stages.count]
kind = "command"
run = ["sh", "-c", "i=0; while [ $i -lt 150 ]; do echo line $i; i=$((i + 1)); sleep 0.2; done; echo $i > $MFLOW_OUTPUT/n"]
EOF
)
  "$MFLOW_BIN" run "$spec" >"$STATE_DIR/$c.out" 2>&1 &
  pid=$!
  wait_until 120 grep -q "count | \[rank 0\] line 10$" "$STATE_DIR/$c.out"
  local t=$SECONDS
  bash "$E2E_DIR/cluster.sh" stop kube-apiserver
  sleep 6
  bash "$E2E_DIR/cluster.sh" start kube-apiserver
  echo "the API server was away for $((SECONDS - t))s"
  wait "$pid" || code=$?
  out=$(cat "$STATE_DIR/$c.out")
  echo "$out"
  eq "$code" 0 "exit code"
  eq "$(record $c | jq -r .stages.count.status)" succeeded
  eq "$(cat "$(record $c | jq -r .stages.count.output)/n")" 150 "the stage's output"
  want=$(seq 0 149 | sed 's/^/[rank 0] line /')
  log=$(attempt_log $c count | grep '^\[rank 0\] line ')
  eq "$log" "$want" "the attempt log, every line once and in order"
  expect 0 mf logs count --workdir "$(case_dir $c)/wd"
  eq "$(last | grep -o '\[rank 0\] line [0-9]*')" "$want" "mflow logs"
  eq "$(grep -o 'count | \[rank 0\] line [0-9]*' <<<"$out" | sed 's/^count | //')" "$want" "the display"
  eq "$(grep -c 'cannot be reached since' <<<"$out")" 1 "lines saying the API server is away"
  contains "$out" "mflow keeps trying"
  eq "$(grep -c 'answers again' <<<"$out")" 1 "lines saying it is back"
  no_raw_logging "$out"
}

# fake_nodes N: N more kwok nodes like localhost (8 GPUs, 32 CPUs each), named kwok-node-I.
fake_nodes() {
  local i
  for i in $(seq 1 "$1"); do
    cat <<EOF
---
apiVersion: v1
kind: Node
metadata:
  name: kwok-node-$i
  labels: {kubernetes.io/hostname: kwok-node-$i, kubernetes.io/os: linux, kubernetes.io/arch: amd64, type: kwok, mflow-e2e/mode: kwok, mflow-e2e/fake: "true"}
  annotations: {kwok.x-k8s.io/node: fake, node.alpha.kubernetes.io/ttl: "0"}
status:
  capacity: {cpu: "32", memory: 256Gi, pods: "110", nvidia.com/gpu: "8", ephemeral-storage: 1Ti}
  allocatable: {cpu: "32", memory: 256Gi, pods: "110", nvidia.com/gpu: "8", ephemeral-storage: 1Ti}
EOF
  done
}

# metric NAME FILTER: the sum of the API server's counter NAME over the series matching FILTER.
metric() {
  kubectl --kubeconfig "$STATE_DIR/kubeconfig/admin.kubeconfig" get --raw /metrics |
    awk -v name="$1" -v filter="$2" 'index($0, name "{") == 1 && $0 ~ filter {sum += $NF} END {printf "%d\n", sum}'
}

# One train stage over 64 kwok nodes of 8 GPUs: tp 8 x pp 2 x dp 32 = 512 ranks, 8 per node.
# mflow runs as mflow-user, whose requests alone fall in API Priority and Fairness's
# global-default flow (the controllers are system:masters, the kubelet a node), so the API
# server's own counters measure mflow: log streams (only mflow reads pod logs), requests per
# second, and the lines it shows. Bounds: at most 4 log requests (rank 0's stream, its last
# read, and a reopening), at most 3 requests/s on average, at most 12 state lines of the stage.
case_many_nodes_kwok() {
  local c=many_nodes_kwok spec out t0 wall logs0 logs1 reqs0 reqs1 code=0
  fake_nodes 63 | kc apply -f - >/dev/null
  wait_until 120 test "$(kc get nodes -l type=kwok -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' | grep -c True)" -ge 64
  spec=$(write_spec $c "train_image = \"$IMAGE\"" <<'EOF'
[env]
python = "python3"

[stages.shards]
kind = "command"
run = ["sh", "-c", "true"]

[stages.data]
kind = "command"
run = ["sh", "-c", "true"]

[stages.train]
kind = "train"
model = "${stages.shards.output}"
data = "${stages.data.output}"
tp = 8
pp = 2
dp = 32
nodes = 64
micro_batch_size = 1
global_batch_size = 32
resources = { gpus = 8 }
env = { MFLOW_E2E_DURATION = "20s" }
EOF
)
  logs0=$(metric apiserver_request_total 'subresource="log"')
  reqs0=$(metric apiserver_flowcontrol_dispatched_requests_total 'flow_schema="global-default"')
  t0=$(date +%s.%N)
  KUBECONFIG="$STATE_DIR/kubeconfig/mflow-user.kubeconfig" "$MFLOW_BIN" run "$spec" >"$STATE_DIR/$c.out" 2>&1 || code=$?
  wall=$(echo "$(date +%s.%N) - $t0" | bc)
  logs1=$(metric apiserver_request_total 'subresource="log"')
  reqs1=$(metric apiserver_flowcontrol_dispatched_requests_total 'flow_schema="global-default"')
  out=$(cat "$STATE_DIR/$c.out")
  echo "$out"
  kc delete nodes -l mflow-e2e/fake=true --wait=false >/dev/null
  local streams=$((logs1 - logs0)) reqs=$((reqs1 - reqs0)) states lines rate
  states=$(grep -c 'train | mflow: TrainJob .* \(running on\|pending\|starting\|pods finished on\)' <<<"$out" || true)
  lines=$(wc -l <<<"$out")
  rate=$(echo "scale=2; $reqs / $wall" | bc)
  echo "measured: wall ${wall}s, log requests $streams, mflow's API requests $reqs ($rate/s), state lines of train $states, lines shown $lines"
  eq "$code" 0 "exit code"
  eq "$(record $c | jq -r .stages.train.status)" succeeded
  eq "$(kc get trainjobs -l "mflow.dev/pipeline=$(pipeline_of $c),mflow.dev/stage=train" -o jsonpath='{.items[0].spec.trainer.numNodes}')" 64 "numNodes"
  eq "$(kc get trainjobs -l "mflow.dev/pipeline=$(pipeline_of $c),mflow.dev/stage=train" -o jsonpath='{.items[0].spec.trainer.numProcPerNode}')" 8 "numProcPerNode"
  contains "$out" "running on 64/64 nodes"
  [ "$streams" -ge 1 ] && [ "$streams" -le 4 ] || { echo "log requests: $streams, bound 1..4"; return 1; }
  [ "$(echo "$rate <= 3" | bc)" = 1 ] || { echo "mflow's API requests: $rate/s, bound 3/s"; return 1; }
  [ "$states" -le 12 ] || { echo "state lines of train: $states, bound 12"; return 1; }
  [ "$lines" -le 60 ] || { echo "lines shown: $lines, bound 60"; return 1; }
  not_contains "$out" "[rank 1]"
}
