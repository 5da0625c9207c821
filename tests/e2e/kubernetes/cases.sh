# shellcheck shell=bash
# The cases of run.sh. Each `case_NAME` runs in a subshell with `set -euo pipefail` and passes
# when it returns 0; what it prints is shown when it fails. They drive the `mflow` binary
# ($MFLOW_BIN) against the cluster and assert on exit codes, objects in the cluster, run records
# and committed outputs on the artifact volume.

KWOK_CASES=(
  dry_run_every_spec
  pipeline_runs_and_is_cached
  failing_stage
  flaky_stage_is_retried
  timeout_is_a_timeout
  sigkill_then_reattach
  sigterm_detaches_and_reattaches
  sigint_cancels
  foreign_object_is_left_alone
  restricted_user
  service_account_bound_by_shipped_rbac
  no_trainer_controller
  train_on_two_nodes
)
KUBELET_CASES=(
  real_outputs_flow_downstream
  real_oom_kill
  missing_and_invalid_images
  cronjob_runs_mflow_in_a_pod
  cronjob_pod_sigterm_detaches
  outside_run_uploads_and_follows
  outside_detach_attach_cancel
  outside_driver_pod_deleted
  outside_records_logs_report_download
  outside_rights_of_a_person
  outside_claim_without_storage_class
  outside_two_laptops_one_spec
  outside_images_that_cannot_drive
)

# mflow sees the artifact volume where its pods do, at /mflow (here: the hostPath behind the
# claim), as it would on a machine that mounts the same share.
VOLUME=/mflow
NS=ml
E2E_IMAGE=mflow-e2e/mflow:dev

setup_phase() {
  MODE=$1
  if [ -e "$VOLUME" ] || [ -L "$VOLUME" ]; then
    [ "$(readlink "$VOLUME" || true)" = "$STATE_DIR/artifacts" ] || die "$VOLUME exists and is not this suite's; move it away first"
  fi
  ln -sfn "$STATE_DIR/artifacts" "$VOLUME"
  export MFLOW_HOME="$STATE_DIR/mflow-home" NO_COLOR=1
  # The kubectl of the cluster's own version.
  export PATH="$KUBE_BIN_DIR:$PATH"
  export KUBECONFIG="$STATE_DIR/kubeconfig/admin.kubeconfig"
  if [ "$MODE" = kubelet ]; then
    # The stage image: busybox and this mflow (stripped: the debug build's line tables are
    # most of its size).
    local lean="$STATE_DIR/mflow"
    cp "$MFLOW_BIN" "$lean"
    strip "$lean" 2>/dev/null || true
    bash "$E2E_DIR/image.sh" "$E2E_IMAGE" "$lean" >"$STATE_DIR/image.log" 2>&1 || { cat "$STATE_DIR/image.log"; die "cannot build the mflow image"; }
    IMAGE=$E2E_IMAGE CPU_RUNTIME=mflow-cpu-hostnet TORCH_RUNTIME=mflow-torch-hostnet
    # The images of docker/Dockerfile (targets cpu-train and cpu) with this mflow, built or
    # reused, and imported: MFLOW_E2E_TRAIN_IMAGE and MFLOW_E2E_CPU_IMAGE name them.
    local images
    images=$(bash "$E2E_DIR/images.sh") || die "cannot build the images of docker/Dockerfile (tests/e2e/kubernetes/images.sh)"
    eval "$(grep -E '^MFLOW_E2E_(TRAIN|CPU)_IMAGE=[a-z0-9./:_-]+$' <<<"$images" | sed 's/^/export /')"
  else
    IMAGE=busybox:1.36 CPU_RUNTIME=mflow-cpu TORCH_RUNTIME=mflow-torch
  fi
  export MODE IMAGE CPU_RUNTIME TORCH_RUNTIME
}

teardown_phase() {
  [ "$(readlink "$VOLUME" 2>/dev/null || true)" = "$STATE_DIR/artifacts" ] && rm -f "$VOLUME"
  return 0
}

kc() { kubectl --kubeconfig "$STATE_DIR/kubeconfig/admin.kubeconfig" -n "$NS" "$@"; }

# The case's directory on the volume and its pipeline name.
case_dir() { echo "$VOLUME/e2e/$1"; }
pipeline_of() { echo "e2e-${1//_/-}"; }

# write_spec CASE [KUBERNETES-LINES] < STAGES: the case's spec on the volume; prints its path.
write_spec() {
  local dir name
  dir=$(case_dir "$1")
  name=$(pipeline_of "$1")
  mkdir -p "$dir"
  {
    printf '[pipeline]\nname = "%s"\nbackend = "kubernetes"\nworkdir = "%s/wd"\n\n' "$name" "$dir"
    printf '[pipeline.kubernetes]\nimage = "%s"\ncpu_runtime = "%s"\nruntime = "%s"\n%s\n\n' "$IMAGE" "$CPU_RUNTIME" "$TORCH_RUNTIME" "${2:-}"
    cat
  } >"$dir/spec.toml"
  echo "$dir/spec.toml"
}

# mf ARGS...: the mflow binary. Cases that signal mflow start "$MFLOW_BIN" itself, so that `$!`
# is mflow's PID and not a subshell's.
mf() { "$MFLOW_BIN" "$@"; }

# expect CODE CMD...: runs CMD, shows its output, and fails unless it exits with CODE.
expect() {
  local want=$1 got=0
  shift
  "$@" >"$STATE_DIR/last.out" 2>&1 || got=$?
  cat "$STATE_DIR/last.out"
  if [ "$got" != "$want" ]; then
    echo "expected exit $want, got $got: $*"
    return 1
  fi
}

# The output of the last `expect`.
last() { cat "$STATE_DIR/last.out"; }

contains() {
  if ! grep -qF -- "$2" <<<"$1"; then
    echo "expected to find: $2"
    return 1
  fi
}

not_contains() {
  if grep -qF -- "$2" <<<"$1"; then
    echo "did not expect: $2"
    return 1
  fi
}

eq() {
  if [ "$1" != "$2" ]; then
    echo "expected '$2', got '$1'${3:+ ($3)}"
    return 1
  fi
}

# The newest run record of a case.
record() { cat "$(ls -d "$(case_dir "$1")"/wd/runs/*/ | sort | tail -n 1)run.json"; }
attempt_log() { cat "$(ls -d "$(case_dir "$1")"/wd/runs/*/ | sort | tail -n 1)stages/$2/attempt-${3:-1}.log" 2>/dev/null || true; }

trainjobs() { kc get trainjobs -l "mflow.dev/pipeline=$(pipeline_of "$1")" -o name | wc -l; }

# wait_until SECONDS CMD...: polls CMD every half second.
wait_until() {
  local limit=$1 t=$SECONDS
  shift
  until "$@" >/dev/null 2>&1; do
    if [ $((SECONDS - t)) -ge "$limit" ]; then
      echo "timed out after ${limit}s waiting for: $*"
      return 1
    fi
    sleep 0.5
  done
}

pod_running() { [ -n "$(kc get pods -l "mflow.dev/pipeline=$(pipeline_of "$1")" --field-selector=status.phase=Running -o name)" ]; }

# --- kwok: simulated pods ------------------------------------------------------------------

# Every spec in the repository, rendered, passes the real API server's strict validation and
# Trainer's and JobSet's admission webhooks; `mflow run --dry-run` says the same.
case_dry_run_every_spec() {
  local spec n=0
  for spec in "$REPO_ROOT"/specs/*.toml "$REPO_ROOT"/specs/examples/*.toml; do
    # A Hub source is resolved over the network at plan time; there is none here.
    grep -q 'hf://' "$spec" && { echo "skipped (needs the Hub): $spec"; continue; }
    echo "== $spec"
    mf render "$spec" --backend kubernetes >"$STATE_DIR/rendered.yaml"
    grep -c '^kind: TrainJob' "$STATE_DIR/rendered.yaml"
    expect 0 kubectl --kubeconfig "$KUBECONFIG" -n "$NS" apply --dry-run=server --validate=strict -f "$STATE_DIR/rendered.yaml"
    expect 0 mf run --dry-run "$spec" --backend kubernetes
    not_contains "$(last)" "rejected"
    contains "$(last)" "accepted (server-side dry run)"
    n=$((n + 1))
  done
  [ "$n" -ge 2 ] || { echo "only $n specs checked"; return 1; }
}

DIAMOND='[stages.prep]
kind = "command"
run = ["sh", "-c", "echo prep > $MFLOW_OUTPUT/x"]

[stages.left]
kind = "command"
needs = ["prep"]
run = ["sh", "-c", "cat $MFLOW_INPUT_PREP/x > $MFLOW_OUTPUT/x"]

[stages.right]
kind = "command"
needs = ["prep"]
nodes = 2
run = ["sh", "-c", "tr a-z A-Z < $MFLOW_INPUT_PREP/x > $MFLOW_OUTPUT/x"]

[stages.join]
kind = "command"
needs = ["left", "right"]
run = ["sh", "-c", "cat $MFLOW_INPUT_LEFT/x $MFLOW_INPUT_RIGHT/x > $MFLOW_OUTPUT/x"]
'

case_pipeline_runs_and_is_cached() {
  local spec
  spec=$(write_spec pipeline_runs_and_is_cached <<<"$DIAMOND")
  expect 0 mf run "$spec"
  eq "$(trainjobs pipeline_runs_and_is_cached)" 4 "TrainJobs"
  eq "$(kc get trainjobs -l mflow.dev/pipeline=e2e-pipeline-runs-and-is-cached -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Complete")].status}{"\n"}{end}' | grep -c True)" 4 "Complete TrainJobs"
  eq "$(record pipeline_runs_and_is_cached | jq -r '[.stages[] | .status] | unique | join(",")')" succeeded
  local out
  for stage in prep left right join; do
    out=$(record pipeline_runs_and_is_cached | jq -r ".stages.$stage.output")
    [ -d "$out" ] || { echo "no committed output for $stage: $out"; return 1; }
  done
  eq "$(kc get configmaps -l mflow.dev/component=cache,mflow.dev/pipeline=e2e-pipeline-runs-and-is-cached -o name | wc -l)" 4 "cache index entries"
  # The 2-node stage requested one CPU per rank, and numNodes 2.
  eq "$(kc get trainjobs -l mflow.dev/stage=right -o jsonpath='{.items[0].spec.trainer.numNodes}')" 2
  # Again: nothing is submitted.
  expect 0 mf run "$spec"
  eq "$(trainjobs pipeline_runs_and_is_cached)" 4 "TrainJobs after the cached run"
  eq "$(record pipeline_runs_and_is_cached | jq -r '[.stages[] | .status] | unique | join(",")')" cached
}

case_failing_stage() {
  local spec
  spec=$(write_spec failing_stage <<'EOF'
[stages.broken]
kind = "command"
env = { MFLOW_E2E_FAIL = "always" }
run = ["sh", "-c", "exit 1"]
EOF
)
  expect 1 mf run "$spec"
  local msg
  msg=$(record failing_stage | jq -r .stages.broken.message)
  contains "$msg" "user: rank 0: container node exited with code 1"
  not_contains "$(last)" "failed (User)"
}

case_flaky_stage_is_retried() {
  local spec
  spec=$(write_spec flaky_stage_is_retried <<'EOF'
[stages.flaky]
kind = "command"
env = { MFLOW_E2E_FAIL = "first" }
retries = { max = 1, backoff = "1s", on = ["user"] }
run = ["sh", "-c", "true"]
EOF
)
  expect 0 mf run "$spec"
  eq "$(record flaky_stage_is_retried | jq -r '[.stages.flaky.attempts[].outcome] | join(",")')" "user,success"
  kc get trainjobs -l mflow.dev/pipeline=e2e-flaky-stage-is-retried -o name | grep -q -- '-a2$'
}

case_timeout_is_a_timeout() {
  local spec
  spec=$(write_spec timeout_is_a_timeout <<'EOF'
[stages.hangs]
kind = "command"
timeout = "5s"
env = { MFLOW_E2E_HANG = "true" }
run = ["sh", "-c", "sleep 1000"]
EOF
)
  expect 3 mf run "$spec"
  local msg
  msg=$(record timeout_is_a_timeout | jq -r .stages.hangs.message)
  contains "$msg" "timeout: "
  eq "$(grep -o 'exceeded its active deadline' <<<"$msg" | wc -l)" 1 "the deadline is said once: $msg"
}

SLOW='[stages.slow]
kind = "command"
env = { MFLOW_E2E_DURATION = "25s" }
run = ["sh", "-c", "true"]
'

# signal_mid_stage CASE SIGNAL: runs the slow stage of CASE, sends mflow SIGNAL once its pod
# runs, and prints mflow's exit code (mflow is started directly, so that `$!` is its PID).
signal_mid_stage() {
  local spec pid code=0
  spec=$(write_spec "$1" <<<"$SLOW")
  "$MFLOW_BIN" run "$spec" >"$STATE_DIR/first.out" 2>&1 &
  pid=$!
  wait_until 60 pod_running "$1" >&2
  kill "-$2" "$pid"
  wait "$pid" || code=$?
  cat "$STATE_DIR/first.out" >&2
  echo "$code"
}

# The next run reattaches to the one TrainJob and submits nothing.
rerun_reattaches() {
  expect 0 mf run "$(case_dir "$1")/spec.toml"
  contains "$(attempt_log "$1" slow)" "reattaching to TrainJob"
  eq "$(trainjobs "$1")" 1 "TrainJobs (none resubmitted)"
}

case_sigkill_then_reattach() {
  signal_mid_stage sigkill_then_reattach KILL >/dev/null
  rerun_reattaches sigkill_then_reattach
}

case_sigterm_detaches_and_reattaches() {
  local c=sigterm_detaches_and_reattaches
  eq "$(signal_mid_stage $c TERM)" 143 "exit code after SIGTERM"
  eq "$(record $c | jq -r .status)" interrupted
  eq "$(record $c | jq -r .stages.slow.status)" interrupted
  # The TrainJob is neither deleted nor being deleted.
  eq "$(kc get trainjobs -l "mflow.dev/pipeline=$(pipeline_of $c)" -o jsonpath='{.items[*].metadata.deletionTimestamp}')" ""
  eq "$(trainjobs $c)" 1
  rerun_reattaches $c
}

case_sigint_cancels() {
  eq "$(signal_mid_stage sigint_cancels INT)" 130 "exit code after SIGINT"
  eq "$(record sigint_cancels | jq -r .status)" cancelled
  wait_until 60 test "$(trainjobs sigint_cancels)" -eq 0
}

case_foreign_object_is_left_alone() {
  local spec name
  spec=$(write_spec foreign_object_is_left_alone <<'EOF'
[stages.taken]
kind = "command"
run = ["sh", "-c", "true"]
EOF
)
  name=$(mf render "$spec" | awk '/^kind: TrainJob/ {tj=1} tj && /^  name:/ {print $2; exit}')
  [ -n "$name" ] || { echo "no TrainJob name in the rendered objects"; return 1; }
  kc apply -f - <<EOF
apiVersion: trainer.kubeflow.org/v1alpha1
kind: TrainJob
metadata: {name: $name, labels: {owner: someone-else}}
spec:
  runtimeRef: {name: $CPU_RUNTIME}
  suspend: true
EOF
  expect 1 mf run "$spec"
  local msg
  msg=$(record foreign_object_is_left_alone | jq -r .stages.taken.message)
  contains "$msg" "was not created by mflow"
  not_contains "$msg" 'Some("'
  eq "$(kc get trainjob "$name" -o jsonpath='{.metadata.labels.owner}')" someone-else "the foreign TrainJob was changed"
  kc delete trainjob "$name" --wait=false
}

case_restricted_user() {
  local spec
  spec=$(write_spec restricted_user <<<"$DIAMOND")
  # A user with no rights is stopped by the preflight, which names what is missing and how to
  # grant it in this namespace.
  KUBECONFIG="$STATE_DIR/kubeconfig/nobody.kubeconfig" expect 3 mf run "$spec"
  contains "$(last | tr -s ' │\n' ' ')" "mflow kube rbac --namespace ml"
  contains "$(last)" "forbidden"
  eq "$(trainjobs restricted_user)" 0
  # mflow-user is bound only by the shipped RBAC (examples/kubernetes/rbac.yaml).
  KUBECONFIG="$STATE_DIR/kubeconfig/mflow-user.kubeconfig" expect 0 mf run "$spec"
  eq "$(trainjobs restricted_user)" 4
}

case_service_account_bound_by_shipped_rbac() {
  local spec sa="$STATE_DIR/sa.kubeconfig"
  bash "$E2E_DIR/cluster.sh" sa-kubeconfig "$NS" mflow "$sa"
  spec=$(write_spec service_account_bound_by_shipped_rbac <<<"$DIAMOND")
  KUBECONFIG="$sa" expect 0 mf run "$spec"
  eq "$(trainjobs service_account_bound_by_shipped_rbac)" 4
}

# Without the Trainer controller (its webhooks out of the way, as with a controller that was
# never installed), a TrainJob is accepted and nothing ever happens to it: mflow says where to
# look and gives up after start_timeout as an infra failure.
case_no_trainer_controller() {
  local spec saved="$STATE_DIR/trainer-webhooks.yaml" code=0
  spec=$(write_spec no_trainer_controller 'start_timeout = "20s"' <<'EOF'
[stages.orphan]
kind = "command"
run = ["sh", "-c", "true"]
EOF
)
  kc get validatingwebhookconfigurations,mutatingwebhookconfigurations -o yaml >/dev/null
  kubectl get validatingwebhookconfigurations,mutatingwebhookconfigurations -o name | grep -i trainer >"$STATE_DIR/trainer-webhook-names"
  xargs kubectl get -o yaml <"$STATE_DIR/trainer-webhook-names" >"$saved"
  bash "$E2E_DIR/cluster.sh" stop trainer
  xargs kubectl delete <"$STATE_DIR/trainer-webhook-names"
  expect 3 mf run "$spec" || code=1
  local out
  out=$(last)
  bash "$E2E_DIR/cluster.sh" start trainer
  kubectl apply -f "$saved" >/dev/null
  [ "$code" = 0 ] || return 1
  contains "$out" "has no pods after 10s"
  contains "$out" "kubeflow-system"
  contains "$(record no_trainer_controller | jq -r .stages.orphan.message)" "did not start within 20s"
  eq "$(trainjobs no_trainer_controller)" 0 "the stuck TrainJob was deleted"
}

# --- kubelet: real pods ---------------------------------------------------------------------

case_real_outputs_flow_downstream() {
  local spec
  spec=$(write_spec real_outputs_flow_downstream <<'EOF'
[stages.number]
kind = "command"
run = ["sh", "-c", "echo 21 > $MFLOW_OUTPUT/n.txt"]

[stages.double]
kind = "command"
needs = ["number"]
run = ["sh", "-c", "echo $(( $(cat $MFLOW_INPUT_NUMBER/n.txt) * 2 )) > $MFLOW_OUTPUT/n.txt"]

[stages.model]
kind = "model"
source = "init:llama-tiny"

[stages.convert]
kind = "convert"
model = "${stages.model.output}"
tp = 2
EOF
)
  expect 0 mf run "$spec"
  local rec out
  rec=$(record real_outputs_flow_downstream)
  out=$(jq -r .stages.double.output <<<"$rec")
  eq "$(cat "$out/n.txt")" 42 "the downstream stage's output"
  out=$(jq -r .stages.model.output <<<"$rec")
  [ -f "$out/config.json" ] && [ -f "$out/model.safetensors" ] || { ls -la "$out"; echo "the model stage wrote no HF model"; return 1; }
  out=$(jq -r .stages.convert.output <<<"$rec")
  find "$out" -name '*.safetensors' | grep -q . || { find "$out"; echo "convert wrote no shards"; return 1; }
  contains "$(attempt_log real_outputs_flow_downstream number)" "completed"
  expect 0 mf run "$spec"
  eq "$(record real_outputs_flow_downstream | jq -r '[.stages[] | .status] | unique | join(",")')" cached
}

case_real_oom_kill() {
  local spec
  spec=$(write_spec real_oom_kill <<'EOF'
[stages.greedy]
kind = "command"
resources = { memory = "32Mi" }
run = ["sh", "-c", "dd if=/dev/zero of=/dev/null bs=256M count=4"]
EOF
)
  expect 1 mf run "$spec"
  contains "$(record real_oom_kill | jq -r .stages.greedy.message)" "oom: rank 0: container node was killed for exceeding its memory limit (OOMKilled)"
}

case_missing_and_invalid_images() {
  local spec
  # An image that no registry can serve (a registry on loopback where nothing listens): the
  # reason is shown while it waits, and the attempt is given up as infra after start_timeout.
  spec=$(write_spec missing_and_invalid_images 'start_timeout = "30s"' <<'EOF'
[stages.missing]
kind = "command"
image = "127.0.0.1:5999/mflow-e2e/not-there:1"
run = ["sh", "-c", "true"]
EOF
)
  expect 3 mf run "$spec"
  contains "$(last)" "ErrImagePull"
  contains "$(record missing_and_invalid_images | jq -r .stages.missing.message)" "did not start within 30s"
  # A name that is not an image reference fails at once, as the user's error.
  spec=$(write_spec missing_and_invalid_images <<'EOF'
[stages.invalid]
kind = "command"
image = "Not A/Valid:Image:Name"
run = ["sh", "-c", "true"]
EOF
)
  expect 1 mf run "$spec"
  contains "$(record missing_and_invalid_images | jq -r .stages.invalid.message)" "InvalidImageName"
}

# cron_job CASE SPEC: applies the objects `mflow schedule render` makes for SPEC, adapted to this
# cluster (the stage image, and the API server on loopback for a host-network pod), and starts
# a Job from the CronJob now; prints the Job's name.
cron_job() {
  local name
  mf schedule render "$2" --namespace "$NS" >"$STATE_DIR/schedule.yaml"
  kc apply -f "$STATE_DIR/schedule.yaml" >/dev/null
  name=$(awk '/^kind: CronJob/ {c=1} c && /^  name:/ {print $2; exit}' "$STATE_DIR/schedule.yaml")
  kc patch cronjob "$name" --type=json -p "[
    {\"op\": \"replace\", \"path\": \"/spec/jobTemplate/spec/template/spec/containers/0/image\", \"value\": \"$E2E_IMAGE\"},
    {\"op\": \"add\", \"path\": \"/spec/jobTemplate/spec/template/spec/hostNetwork\", \"value\": true},
    {\"op\": \"add\", \"path\": \"/spec/jobTemplate/spec/template/spec/containers/0/env/-\", \"value\": {\"name\": \"KUBERNETES_SERVICE_HOST\", \"value\": \"127.0.0.1\"}},
    {\"op\": \"add\", \"path\": \"/spec/jobTemplate/spec/template/spec/containers/0/env/-\", \"value\": {\"name\": \"KUBERNETES_SERVICE_PORT\", \"value\": \"6443\"}}
  ]" >/dev/null
  kc create job "$1" --from="cronjob/$name" >/dev/null
  echo "$1"
}

SCHEDULED='[schedule]
cron = "0 3 * * *"

[stages.hello]
kind = "command"
run = ["sh", "-c", "echo hello > $MFLOW_OUTPUT/greeting"]

[stages.shout]
kind = "command"
needs = ["hello"]
run = ["sh", "-c", "tr a-z A-Z < $MFLOW_INPUT_HELLO/greeting > $MFLOW_OUTPUT/greeting"]
'

case_cronjob_runs_mflow_in_a_pod() {
  local spec job dir
  spec=$(write_spec cronjob_runs_mflow_in_a_pod <<<"$SCHEDULED")
  job=$(cron_job cron-now "$spec")
  if ! kc wait --for=condition=Complete "job/$job" --timeout=180s; then
    kc logs "job/$job" --tail=80 || true
    kc describe "job/$job" | tail -20
    return 1
  fi
  kc logs "job/$job" | tail -20
  dir="$VOLUME/pipelines/mflow-e2e-cronjob-runs-mflow-in-a-pod"
  [ -s "$dir/junit.xml" ] && [ -s "$dir/report.html" ] || { ls -la "$dir"; echo "no JUnit file or report"; return 1; }
  eq "$(record cronjob_runs_mflow_in_a_pod | jq -r .status)" succeeded
  out=$(record cronjob_runs_mflow_in_a_pod | jq -r .stages.shout.output)
  eq "$(cat "$out/greeting")" HELLO
  eq "$(trainjobs cronjob_runs_mflow_in_a_pod)" 2
}

# A pod running mflow is deleted (as by a drain or an eviction): mflow, the container's main
# process, hears SIGTERM, records the run as interrupted, writes its report, and leaves the
# TrainJob running.
case_cronjob_pod_sigterm_detaches() {
  local spec job pod dir
  spec=$(write_spec cronjob_pod_sigterm_detaches <<'EOF'
[schedule]
cron = "0 3 * * *"

[stages.long]
kind = "command"
run = ["sh", "-c", "sleep 3600"]
EOF
)
  job=$(cron_job cron-drain "$spec")
  wait_until 120 pod_running cronjob_pod_sigterm_detaches
  pod=$(kc get pods -l "job-name=$job" -o jsonpath='{.items[0].metadata.name}')
  kc delete pod "$pod" --wait=true --timeout=150s
  kc logs "job/$job" 2>/dev/null | tail -5 || true
  dir="$VOLUME/pipelines/mflow-e2e-cronjob-pod-sigterm-detaches"
  eq "$(record cronjob_pod_sigterm_detaches | jq -r .status)" interrupted
  [ -s "$dir/report.html" ] || { ls -la "$dir"; echo "no report after SIGTERM"; return 1; }
  eq "$(trainjobs cronjob_pod_sigterm_detaches)" 1 "the TrainJob was left running"
  eq "$(kc get trainjobs -l mflow.dev/pipeline=e2e-cronjob-pod-sigterm-detaches -o jsonpath='{.items[*].metadata.deletionTimestamp}')" ""
  kc delete trainjobs -l mflow.dev/pipeline=e2e-cronjob-pod-sigterm-detaches --wait=false
}

# A train stage on 2 nodes is one TrainJob of numNodes 2: its tp x pp x dp = 4 ranks split 2
# per node, each node asks for a core per rank, and torchrun takes the rendezvous from the
# PET_* variables that Trainer gives each node's pod.
case_train_on_two_nodes() {
  local spec
  # The image has its own Python: the local one only enters the key, and naming it spares
  # provisioning the workloads' environment here.
  spec=$(write_spec train_on_two_nodes "train_image = \"$IMAGE\"" <<'EOF'
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
engine = "reference"
tp = 2
pp = 2
nodes = 2
micro_batch_size = 4
global_batch_size = 8
EOF
)
  mf render "$spec" >"$STATE_DIR/rendered.yaml"
  local rendered
  rendered=$(awk '/mflow.dev\/stage-name: train/,0' "$STATE_DIR/rendered.yaml")
  contains "$rendered" "numNodes: 2"
  contains "$rendered" "numProcPerNode: 2"
  # torchrun gets no topology of its own on the cluster: it is Trainer's.
  not_contains "$rendered" "--nproc-per-node"
  expect 0 mf run "$spec"
  local sel="mflow.dev/pipeline=$(pipeline_of train_on_two_nodes),mflow.dev/stage=train"
  eq "$(kc get trainjobs -l "$sel" -o jsonpath='{.items[0].spec.trainer.numNodes}')" 2 "numNodes"
  eq "$(kc get trainjobs -l "$sel" -o jsonpath='{.items[0].spec.trainer.numProcPerNode}')" 2 "numProcPerNode"
  eq "$(kc get trainjobs -l "$sel" -o jsonpath='{.items[0].spec.trainer.resourcesPerNode.requests.cpu}')" 2 "CPU request per node"
  eq "$(record train_on_two_nodes | jq -r .stages.train.status)" succeeded
  # One pod per node, each told the whole topology by Trainer.
  eq "$(kc get pods -l "$sel" -o name | wc -l)" 2 "train pods"
  local pod
  for pod in $(kc get pods -l "$sel" -o name); do
    eq "$(kc get "$pod" -o jsonpath='{.spec.containers[0].env[?(@.name=="PET_NNODES")].value}')" 2 "PET_NNODES of $pod"
    eq "$(kc get "$pod" -o jsonpath='{.spec.containers[0].env[?(@.name=="PET_NPROC_PER_NODE")].value}')" 2 "PET_NPROC_PER_NODE of $pod"
  done
}

# --- from outside the cluster: the volume is not mounted where mflow runs -----------------

# outside_spec CASE < STAGES: a spec in a directory that is not the volume (a laptop's
# checkout); the workdir is the default one on the volume. Prints its path.
outside_spec() {
  local dir="$STATE_DIR/outside/$1"
  mkdir -p "$dir"
  {
    printf '[pipeline]\nname = "%s"\nbackend = "kubernetes"\n\n' "$(pipeline_of "$1")"
    printf '[pipeline.kubernetes]\nimage = "%s"\ncpu_runtime = "%s"\nruntime = "%s"\n' "$IMAGE" "$CPU_RUNTIME" "$TORCH_RUNTIME"
    # This cluster's pods reach the API server on the node's loopback only.
    printf 'driver = { host_network = true, env = { KUBERNETES_SERVICE_HOST = "127.0.0.1", KUBERNETES_SERVICE_PORT = "6443" } }\n\n'
    cat
  } >"$dir/spec.toml"
  echo "$dir/spec.toml"
}

# outside CMD...: runs CMD with /mflow absent, as on a laptop; the link is back afterwards so
# that the case can check the volume.
outside() {
  local rc=0
  rm -f "$VOLUME"
  "$@" || rc=$?
  ln -sfn "$STATE_DIR/artifacts" "$VOLUME"
  return $rc
}

outside_runs() { ls -d "$VOLUME/$(pipeline_of "$1")"/runs/*/ | sort; }
outside_record() { cat "$VOLUME/$(pipeline_of "$1")/runs/$2/run.json"; }
stage_running() { [ -n "$(kc get pods -l "mflow.dev/pipeline=$(pipeline_of "$1"),mflow.dev/stage=$2" --field-selector=status.phase=Running -o name)" ]; }
driver_pod() { kc get pods -l "mflow.dev/run=$1" --field-selector=status.phase=Running -o name | head -n 1 | grep .; }

# A pipeline of three stages from a checkout with a local input: the project is uploaded, the
# driver runs it, the display and exit code are a local run's. A second run sends nothing and
# runs nothing; a changed input is the only file sent; an upload above the bound is refused.
case_outside_run_uploads_and_follows() {
  local spec dir rec out
  spec=$(outside_spec outside_run_uploads_and_follows <<'EOF'
[stages.words]
kind = "command"
inputs = ["data/words.txt"]
run = ["sh", "-c", "wc -w < data/words.txt > $MFLOW_OUTPUT/n"]

[stages.times]
kind = "command"
needs = ["words"]
run = ["sh", "-c", "echo $(( $(cat $MFLOW_INPUT_WORDS/n) * 10 )) > $MFLOW_OUTPUT/n"]

[stages.model]
kind = "model"
source = "init:llama-tiny"
EOF
)
  dir=$(dirname "$spec")
  mkdir -p "$dir/data"
  echo "one two three four" >"$dir/data/words.txt"
  expect 0 outside mf run "$spec"
  contains "$(last)" "upload: sent 2 of 2 files"
  contains "$(last)" "✓ words succeeded"
  contains "$(last)" "times | mflow: TrainJob"
  contains "$(last)" "succeeded: 3 ran, 0 cached, 0 failed"
  [ ! -e "$dir/.mflow" ] || { echo "a workdir was written outside the cluster"; return 1; }
  rec=$(outside_record outside_run_uploads_and_follows "$(basename "$(outside_runs outside_run_uploads_and_follows | tail -n 1)")")
  eq "$(jq -r .status <<<"$rec")" succeeded
  out=$(jq -r .stages.times.output <<<"$rec")
  eq "$(cat "$out/n")" 40 "the downstream stage read the uploaded input"
  [ -f "$(jq -r .stages.model.output <<<"$rec")/model.safetensors" ] || { echo "the model stage wrote no model"; return 1; }

  expect 0 outside mf run "$spec"
  contains "$(last)" "upload: nothing to send, the project is on the volume (2 files)"
  contains "$(last)" "succeeded: 0 ran, 3 cached, 0 failed"
  eq "$(trainjobs outside_run_uploads_and_follows)" 3 "TrainJobs after the cached run"

  echo "five" >>"$dir/data/words.txt"
  expect 2 outside env MFLOW_UPLOAD_MAX_BYTES=10 "$MFLOW_BIN" run "$spec"
  contains "$(last)" "more than the limit of 10 B"
  contains "$(last)" "data/words.txt (24 B)"
  expect 0 outside mf run "$spec"
  contains "$(last)" "upload: sent 1 of 2 files"
  contains "$(last)" "succeeded: 2 ran, 1 cached, 0 failed"
}

# --detach returns the run id; attach follows it and Ctrl-C leaves it running; cancel stops
# its stages, deletes their TrainJobs and records the run as cancelled.
case_outside_detach_attach_cancel() {
  local spec run pid rc=0 log="$STATE_DIR/attach.log"
  spec=$(outside_spec outside_detach_attach_cancel <<'EOF'
[stages.long]
kind = "command"
run = ["sh", "-c", "echo working; sleep 3600"]
EOF
)
  run=$(outside mf run --detach "$spec" 2>"$STATE_DIR/detach.err")
  cat "$STATE_DIR/detach.err"
  [ -n "$run" ] || { echo "--detach printed no run id"; return 1; }
  contains "$(cat "$STATE_DIR/detach.err")" "mflow attach $run"
  wait_until 120 stage_running outside_detach_attach_cancel long

  rm -f "$VOLUME"
  "$MFLOW_BIN" attach "$run" >"$log" 2>&1 &
  pid=$!
  wait_until 60 grep -q "long | \[rank 0\] working" "$log" || { cat "$log"; kill $pid; return 1; }
  kill -INT $pid
  wait $pid || rc=$?
  ln -sfn "$STATE_DIR/artifacts" "$VOLUME"
  cat "$log"
  eq "$rc" 143 "attach after Ctrl-C"
  contains "$(cat "$log")" "detached: run $run goes on in the cluster"
  driver_pod "$run" >/dev/null || { echo "the driver stopped when attach was interrupted"; return 1; }
  eq "$(trainjobs outside_detach_attach_cancel)" 1

  expect 0 outside mf cancel "$run"
  contains "$(last)" "run $run cancelled"
  eq "$(outside_record outside_detach_attach_cancel "$run" | jq -r .status)" cancelled
  wait_until 60 test "$(trainjobs outside_detach_attach_cancel)" = 0
  expect 2 outside mf cancel no-such-run
  contains "$(last)" "no run no-such-run in namespace ml"
}

# The driver's pod is deleted mid-run, as by a drain: the Job starts another, which reattaches
# to the running TrainJob; nothing runs twice and the run ends as it would have.
case_outside_driver_pod_deleted() {
  local spec run pod count
  count="$VOLUME/$(pipeline_of outside_driver_pod_deleted)-starts"
  rm -f "$count"
  spec=$(outside_spec outside_driver_pod_deleted <<EOF
[stages.slow]
kind = "command"
run = ["sh", "-c", "echo started >> $count; sleep 25; echo done > \$MFLOW_OUTPUT/x"]

[stages.after]
kind = "command"
needs = ["slow"]
run = ["sh", "-c", "cat \$MFLOW_INPUT_SLOW/x > \$MFLOW_OUTPUT/x"]
EOF
)
  run=$(outside mf run --detach "$spec")
  wait_until 120 stage_running outside_driver_pod_deleted slow
  pod=$(driver_pod "$run")
  kc delete "$pod" --wait=true --timeout=150s
  expect 0 outside timeout 300 "$MFLOW_BIN" attach "$run"
  contains "$(last)" "reattaching to TrainJob"
  contains "$(last)" "run $run.2 succeeded: 2 ran, 0 cached, 0 failed"
  eq "$(wc -l <"$count")" 1 "times the slow stage started"
  eq "$(outside_record outside_driver_pod_deleted "$run" | jq -r .status)" interrupted
  eq "$(outside_record outside_driver_pod_deleted "$run.2" | jq -r .status)" succeeded
  eq "$(trainjobs outside_driver_pod_deleted)" 2
}

# From the laptop, the cluster's runs are listed and read as local ones are: runs, status,
# logs (followed while the stage runs), the HTML report, and an output brought back checked
# against its digests into a directory that appears whole.
case_outside_records_logs_report_download() {
  local spec dir run path
  spec=$(outside_spec outside_records_logs_report_download <<'EOF'
[stages.tick]
kind = "command"
run = ["sh", "-c", "for i in 1 2 3 4 5; do echo tick $i; sleep 2; done; echo 5 > $MFLOW_OUTPUT/n"]

[stages.model]
kind = "model"
source = "init:llama-tiny"

# An input already on the volume: hashed by the driver, not sent.
[stages.shared]
kind = "command"
inputs = ["/mflow/e2e/outside-shared.txt"]
run = ["sh", "-c", "cat /mflow/e2e/outside-shared.txt > $MFLOW_OUTPUT/x"]
EOF
)
  dir=$(dirname "$spec")
  mkdir -p "$VOLUME/e2e"
  echo "on the volume" >"$VOLUME/e2e/outside-shared.txt"
  run=$(outside mf run --detach "$spec")
  wait_until 120 stage_running outside_records_logs_report_download tick
  expect 0 outside timeout 120 "$MFLOW_BIN" logs "$run" tick --follow --backend kubernetes
  contains "$(last)" "tick 1"
  contains "$(last)" "tick 5"
  expect 0 outside timeout 300 "$MFLOW_BIN" attach "$run"

  expect 0 outside mf runs --backend kubernetes
  contains "$(last)" "$run  succeeded"
  contains "$(last)" "ran 3, cached 0  driver succeeded"
  eq "$(cat "$(outside_record outside_records_logs_report_download "$run" | jq -r .stages.shared.output)/x")" "on the volume"
  expect 0 outside mf status "$run" --backend kubernetes
  contains "$(last)" "run $run ($(pipeline_of outside_records_logs_report_download)) Succeeded"
  contains "$(last)" "tick"
  expect 0 outside mf logs tick --backend kubernetes
  contains "$(last)" "tick 3"
  expect 2 outside mf status no-such-run --backend kubernetes
  contains "$(last)" "no run no-such-run in namespace ml"

  expect 0 outside mf report "$run" --backend kubernetes --out "$dir/report.html"
  grep -q "<html" "$dir/report.html" || { echo "the report is not HTML"; return 1; }
  grep -q "$run" "$dir/report.html" || { echo "the report does not name the run"; return 1; }
  if ls -A "$dir" | grep -q partial; then echo "a partial report was left"; return 1; fi

  expect 0 outside mf output "$spec" model
  path=$(last | tail -n 1)
  case $path in /mflow/*) ;; *) echo "not a path on the volume: $path"; return 1 ;; esac
  expect 0 outside mf output "$spec" model --download "$dir/model"
  contains "$(last)" "each checked against its digest"
  cmp "$dir/model/model.safetensors" "$path/model.safetensors"
  cmp "$dir/model/config.json" "$path/config.json"
  expect 2 outside mf output "$spec" model --download "$dir/model"
  contains "$(last)" "exists"
  expect 2 outside env MFLOW_DOWNLOAD_MAX_BYTES=1000 "$MFLOW_BIN" output "$spec" model --download "$dir/small"
  contains "$(last)" "more than the download bound"
  [ ! -e "$dir/small" ] || { echo "a refused download left a directory"; return 1; }
}

# A person gets the rights to run from a laptop from `mflow kube rbac --user`; the engine's
# rights alone (mflow-user) are stopped by the preflight, which names what is missing.
case_outside_rights_of_a_person() {
  local spec
  spec=$(outside_spec outside_rights_of_a_person <<'EOF'
[stages.one]
kind = "command"
run = ["sh", "-c", "echo 1 > $MFLOW_OUTPUT/x"]
EOF
)
  KUBECONFIG="$STATE_DIR/kubeconfig/mflow-user.kubeconfig" expect 3 outside mf run "$spec"
  contains "$(last)" "create pods/exec"
  "$MFLOW_BIN" kube rbac --namespace "$NS" --user mflow-laptop --name mflow-laptop | kc apply -f -
  KUBECONFIG="$STATE_DIR/kubeconfig/mflow-laptop.kubeconfig" expect 0 outside mf run "$spec"
  contains "$(last)" "succeeded: 1 ran"
  KUBECONFIG="$STATE_DIR/kubeconfig/mflow-laptop.kubeconfig" expect 0 outside mf runs --backend kubernetes
  contains "$(last)" "succeeded"
}

# A claim made where no StorageClass was the default stays Pending for good: the upload pod
# cannot start, and mflow says why within seconds instead of waiting out its 5 minutes.
case_outside_claim_without_storage_class() {
  local spec t0
  kc apply -f - <<'EOF'
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: mflow-no-class}
spec:
  accessModes: [ReadWriteMany]
  resources: {requests: {storage: 1Gi}}
EOF
  spec=$(outside_spec outside_claim_without_storage_class <<'EOF'
[stages.one]
kind = "command"
run = ["true"]
EOF
)
  sed -i 's/^\[pipeline.kubernetes\]$/[pipeline.kubernetes]\npvc = "mflow-no-class"/' "$spec"
  t0=$(date +%s)
  expect 3 outside mf run "$spec"
  contains "$(last)" "the claim mflow-no-class is Pending and names no StorageClass"
  [ $(( $(date +%s) - t0 )) -lt 120 ] || { echo "took more than 2 minutes"; return 1; }
  [ -z "$(kc get pods -l mflow.dev/component=volume -o json | jq -r '.items[] | select(.spec.volumes[0].persistentVolumeClaim.claimName == "mflow-no-class") | .metadata.name')" ] \
    || { echo "the volume pod of the unbound claim was left"; return 1; }
  kc delete pvc mflow-no-class --wait=false
}

# Two people start the same spec at once, each from a checkout of their own: both uploads
# complete, both drivers run, and each stage runs once; the later run finds it cached.
case_outside_two_laptops_one_spec() {
  local a b count ra rb
  count="$VOLUME/$(pipeline_of outside_two_laptops_one_spec)-starts"
  rm -f "$count"
  a=$(outside_spec outside_two_laptops_one_spec <<EOF
[stages.slow]
kind = "command"
inputs = ["data.txt"]
run = ["sh", "-c", "echo started >> $count; sleep 15; cat data.txt > \$MFLOW_OUTPUT/x"]
EOF
)
  echo same >"$(dirname "$a")/data.txt"
  b="$STATE_DIR/outside/second-laptop/spec.toml"
  mkdir -p "$(dirname "$b")"
  cp "$a" "$(dirname "$a")/data.txt" "$(dirname "$b")/"
  rm -f "$VOLUME"
  "$MFLOW_BIN" run "$a" >"$STATE_DIR/laptop-a.log" 2>&1 &
  ra=$!
  "$MFLOW_BIN" run "$b" >"$STATE_DIR/laptop-b.log" 2>&1 &
  rb=$!
  local ca=0 cb=0
  wait $ra || ca=$?
  wait $rb || cb=$?
  ln -sfn "$STATE_DIR/artifacts" "$VOLUME"
  cat "$STATE_DIR/laptop-a.log" "$STATE_DIR/laptop-b.log"
  eq "$ca" 0 "exit of the first laptop"
  eq "$cb" 0 "exit of the second laptop"
  eq "$(wc -l <"$count")" 1 "times the stage started"
  contains "$(cat "$STATE_DIR/laptop-a.log" "$STATE_DIR/laptop-b.log")" "0 ran, 1 cached"
  # Both drivers ran the one uploaded tree, and neither upload was left inside it.
  local projects tree
  projects=$(kc get jobs -l "mflow.dev/component=driver,mflow.dev/pipeline=$(pipeline_of outside_two_laptops_one_spec)" -o json | jq -r '.items[].metadata.annotations["mflow.dev/project"]' | sort -u)
  if [ "$(wc -l <<<"$projects")" != 1 ]; then
    for t in $projects; do ls -la "$t"; done
    diff -r $projects || true
    echo "two trees for one project"; return 1
  fi
  tree=$(basename "$projects")
  if ls -d "$projects/$tree".* 2>/dev/null; then
    ls -la "$projects"; echo "an upload was left inside the tree"; return 1
  fi
}

# The driver runs the image's mflow: an image that cannot be pulled, or one without mflow, is
# refused before anything is uploaded or started, naming the image.
case_outside_images_that_cannot_drive() {
  local spec
  bash "$E2E_DIR/image.sh" mflow-e2e/plain:dev >"$STATE_DIR/plain-image.log" 2>&1 || { cat "$STATE_DIR/plain-image.log"; return 1; }
  spec=$(outside_spec outside_images_that_cannot_drive <<'EOF'
[stages.one]
kind = "command"
run = ["true"]
EOF
)
  sed -i 's|^image = .*|image = "mflow-e2e/plain:dev"|' "$spec"
  expect 2 outside mf run "$spec"
  contains "$(last)" "the image mflow-e2e/plain:dev has no mflow to run"
  sed -i 's|^image = .*|image = "127.0.0.1:5999/mflow-e2e/not-there:1"|' "$spec"
  expect 2 outside timeout 120 "$MFLOW_BIN" run "$spec"
  contains "$(last)" "the image 127.0.0.1:5999/mflow-e2e/not-there:1 cannot be pulled"
  eq "$(kc get jobs -l "mflow.dev/component=driver,mflow.dev/pipeline=$(pipeline_of outside_images_that_cannot_drive)" -o name | wc -l)" 0 "drivers started"
}

# Further cases, by subject.
for cases_file in "$E2E_DIR"/cases-*.sh; do
  # shellcheck source=/dev/null
  . "$cases_file"
done
unset cases_file
