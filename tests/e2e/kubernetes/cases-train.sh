# shellcheck shell=bash
# Cases of run.sh (the main job as TrainJobs on the real kubelet: training, evaluation and export from the images of docker/Dockerfile).
# Sourced by cases.sh; each case_NAME follows its conventions.

KWOK_CASES+=()
KUBELET_CASES+=(
  main_job_on_kubelet
  main_job_pp2_on_kubelet
  train_pod_deleted_resumes
  train_on_two_nodes_kubelet
)

# The images docker/Dockerfile builds (images.sh): `cpu-train` trains, `cpu` runs the native
# stages and the driver.
TRAIN_IMAGE="${MFLOW_E2E_TRAIN_IMAGE:-localhost/mflow-cpu-train:e2e}"
CPU_IMAGE="${MFLOW_E2E_CPU_IMAGE:-localhost/mflow-cpu:e2e}"
# Iterations of the main job here: the spec's own (300) unless given; fewer make the gates a
# matter of which files the checkout's corpus holds.
MAIN_ITERATIONS="${MFLOW_E2E_MAIN_ITERATIONS:-}"
# The Python environment of the local run the main job is compared with: the one provisioned
# before the suite (setup_phase gives mflow a home of its own). Read when run.sh sources this.
MFLOW_E2E_LOCAL_HOME="${MFLOW_E2E_LOCAL_HOME:-${MFLOW_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/mflow}}"
export MFLOW_E2E_LOCAL_HOME

# prepare_train_case: the images, and a volume that this mflow (root) and the pods of those
# images (uid 1000) both write: the workdirs mflow makes here, and the upload area that earlier
# cases' root pods made.
prepare_train_case() {
  local i
  # Built once and cached by images.sh; imported here when the phase did not.
  bash "$E2E_DIR/images.sh" >"$STATE_DIR/images.log" 2>&1 || { tail -n 30 "$STATE_DIR/images.log"; return 1; }
  for i in "$TRAIN_IMAGE" "$CPU_IMAGE"; do
    ctr --address "$STATE_DIR/containerd/containerd.sock" --namespace k8s.io images ls -q "name==$i" | grep -q . ||
      { echo "the image $i is not in the cluster's containerd (tests/e2e/kubernetes/images.sh builds it)"; return 1; }
  done
  umask 0000
  [ ! -d "$VOLUME/.mflow-uploads" ] || chmod -R a+rwX "$VOLUME/.mflow-uploads"
}

# A user's checkout of this repository (HEAD), made once per cluster: the main job reads its
# docs and sources, which must not change between the runs a case compares.
checkout() {
  local dir="$STATE_DIR/checkout"
  if [ ! -d "$dir/.git" ]; then
    rm -rf "$dir.tmp"
    git clone -q --shared "$REPO_ROOT" "$dir.tmp" >&2
    mv "$dir.tmp" "$dir"
  fi
  echo "$dir"
}

# main_args: `mflow run` arguments that point specs/gpt-tp2.toml at this cluster, as a user
# does from outside it: backend, namespace, images and runtimes, the driver's way to the API
# server (this cluster's pods reach it on the node's loopback only), and fewer iterations.
main_args() {
  printf '%s\n' --backend kubernetes \
    --set "pipeline.kubernetes.namespace=\"$NS\"" \
    --set "pipeline.kubernetes.image=\"$CPU_IMAGE\"" \
    --set "pipeline.kubernetes.train_image=\"$TRAIN_IMAGE\"" \
    --set "pipeline.kubernetes.runtime=\"$TORCH_RUNTIME\"" \
    --set "pipeline.kubernetes.cpu_runtime=\"$CPU_RUNTIME\"" \
    --set "pipeline.kubernetes.driver.host_network=true" \
    --set 'pipeline.kubernetes.driver.env.KUBERNETES_SERVICE_HOST="127.0.0.1"' \
    --set 'pipeline.kubernetes.driver.env.KUBERNETES_SERVICE_PORT="6443"'
  [ -z "$MAIN_ITERATIONS" ] || printf '%s\n' --set "vars.iterations=$MAIN_ITERATIONS"
}

# run_id_of OUTPUT: the run id a run from outside the cluster printed.
run_id_of() { sed -n 's/^run \([^ :]*\): driver job.*/\1/p' <<<"$1" | head -n 1; }

main_record() { cat "$VOLUME/gpt-tp2/runs/$1/run.json"; }

# pet POD NAME: a PET_* variable of the pod's trainer container, as Trainer set it.
pet() { kc get "$1" -o jsonpath="{.spec.containers[0].env[?(@.name==\"$2\")].value}"; }

# check_torch_pods STAGE_SELECTOR NNODES NPROC: the stage's pods are torchrun on Trainer's
# torch runtime with the topology in PET_* from the Trainer controller, and the master's name
# (a pod of the headless Service) was resolved by the cluster's DNS.
check_torch_pods() {
  local sel=$1 nnodes=$2 nproc=$3 tj pod ranks=""
  tj=$(kc get trainjobs -l "$sel" -o jsonpath='{.items[0].metadata.name}')
  eq "$(kc get trainjob "$tj" -o jsonpath='{.spec.runtimeRef.name}')" "$TORCH_RUNTIME" "runtime of $tj"
  eq "$(kc get trainjob "$tj" -o jsonpath='{.spec.trainer.numNodes}')" "$nnodes" "numNodes of $tj"
  eq "$(kc get trainjob "$tj" -o jsonpath='{.spec.trainer.numProcPerNode}')" "$nproc" "numProcPerNode of $tj"
  # mflow sets no PET_* itself: Trainer's webhook would refuse it.
  not_contains "$(kc get trainjob "$tj" -o jsonpath='{.spec.trainer.env[*].name}')" PET_
  eq "$(kc get pods -l "jobset.sigs.k8s.io/jobset-name=$tj" -o name | wc -l)" "$nnodes" "pods of $tj"
  for pod in $(kc get pods -l "jobset.sigs.k8s.io/jobset-name=$tj" -o name); do
    # Trainer's trainer.command and .args become the container's.
    eq "$(kc get "$pod" -o jsonpath='{.spec.containers[0].command[0]} {.spec.containers[0].args[0]} {.spec.containers[0].args[1]}')" \
      "python -m torch.distributed.run" "command of $pod"
    eq "$(pet "$pod" PET_NNODES)" "$nnodes" "PET_NNODES of $pod"
    eq "$(pet "$pod" PET_NPROC_PER_NODE)" "$nproc" "PET_NPROC_PER_NODE of $pod"
    eq "$(pet "$pod" PET_MASTER_ADDR)" "$tj-node-0-0.$tj" "PET_MASTER_ADDR of $pod"
    eq "$(pet "$pod" PET_MASTER_PORT)" 29500 "PET_MASTER_PORT of $pod"
    # The node rank is the pod's completion index, which Trainer passes by reference.
    eq "$(kc get "$pod" -o jsonpath='{.spec.containers[0].env[?(@.name=="PET_NODE_RANK")].valueFrom.fieldRef.fieldPath}')" \
      "metadata.annotations['batch.kubernetes.io/job-completion-index']" "PET_NODE_RANK of $pod"
    ranks="$ranks $(kc get "$pod" -o jsonpath='{.metadata.annotations.batch\.kubernetes\.io/job-completion-index}')"
    eq "$(kc get "$pod" -o jsonpath='{.status.phase}')" Succeeded "phase of $pod"
  done
  eq "$(tr ' ' '\n' <<<"$ranks" | grep . | sort -n | tr '\n' ' ')" "$(seq 0 $((nnodes - 1)) | tr '\n' ' ')" "PET_NODE_RANK of the pods"
  grep -q "A $tj-node-0-0.$tj.$NS.svc.cluster.local -> 127.0.0.1" "$STATE_DIR/logs/dns.log" ||
    { echo "the cluster's DNS never answered $tj-node-0-0.$tj"; return 1; }
}

# stage_keys RECORD_DIR: "stage key output_digest" per stage of a run's lockfile.
stage_keys() { jq -r '.stages | to_entries[] | "\(.key) \(.value.key) \(.value.output_digest)"' "$1/mflow.lock" | sort; }

# run_main CASE EXTRA_ARGS...: specs/gpt-tp2.toml of a checkout, on this cluster, from outside
# it; checks the pipeline's TrainJobs and returns the run id on stdout.
run_main() {
  local dir args run
  dir=$(checkout)
  mapfile -t args < <(main_args)
  shift
  expect 0 outside mf run "$dir/specs/gpt-tp2.toml" "${args[@]}" "$@" >&2
  contains "$(last)" "upload: " >&2
  contains "$(last)" "succeeded: " >&2
  run=$(run_id_of "$(last)")
  [ -n "$run" ] || { echo "no run id in the output" >&2; return 1; }
  echo "$run"
}

# check_main_run RUN NPROC: every stage succeeded; train, evaluate and export were TrainJobs;
# the gates passed.
check_main_run() {
  local run=$1 nproc=$2 rec
  rec=$(main_record "$run")
  eq "$(jq -r .status <<<"$rec")" succeeded "run status"
  # Stages an earlier case of this cluster ran are cached; none failed or was skipped.
  eq "$(jq -r '[.stages[] | .status | select(. != "succeeded" and . != "cached")] | join(",")' <<<"$rec")" "" "stages neither succeeded nor cached"
  eq "$(jq -r '.stages.train.status' <<<"$rec")" succeeded "train"
  local stage
  for stage in train evaluate export; do
    eq "$(kc get trainjobs -l "mflow.dev/pipeline=gpt-tp2,mflow.dev/stage=$stage,mflow.dev/key=$(jq -r ".stages.$stage.key[:32]" <<<"$rec")" \
      -o jsonpath='{.items[0].status.conditions[?(@.type=="Complete")].status}')" True "TrainJob of $stage Complete"
  done
  check_torch_pods "mflow.dev/pipeline=gpt-tp2,mflow.dev/stage=train,mflow.dev/key=$(jq -r '.stages.train.key[:32]' <<<"$rec")" 1 "$nproc"
  eq "$(jq -r '[.stages.evaluate.gates[] | .passed] | all' <<<"$rec")" true "gates passed"
  jq -r '.stages.evaluate.gates[] | "gate \(.metric) \(.condition): \(.value) \(.passed)"' <<<"$rec"
  [ -f "$(jq -r .stages.export.output <<<"$rec")/model.safetensors" ] || { echo "export wrote no HF model"; return 1; }
}

# The main job, as a user runs it from a checkout: model, convert, dataset, train (TP=2 on 2
# gloo ranks in one pod), evaluate with its gates, export; then again, all cached; and the keys
# and output digests are those a local run of the same spec leaves.
case_main_job_on_kubelet() {
  prepare_train_case
  local run t=$SECONDS
  run=$(run_main main_job_on_kubelet)
  echo "cluster run $run: $((SECONDS - t))s"
  check_main_run "$run" 2
  contains "$(attempt_log_of "$run" train)" "[rank 0]"

  local args dir
  dir=$(checkout)
  mapfile -t args < <(main_args)
  expect 0 outside mf run "$dir/specs/gpt-tp2.toml" "${args[@]}"
  contains "$(last)" "0 ran"
  eq "$(main_record "$(run_id_of "$(last)")" | jq -r '[.stages[] | .status] | unique | join(",")')" cached "second run"

  # The same spec run here, with the local backend, into the checkout's own workdir.
  t=$SECONDS
  local iterations=()
  [ -z "$MAIN_ITERATIONS" ] || iterations=(--set "vars.iterations=$MAIN_ITERATIONS")
  (cd "$dir" && env -u MFLOW_PYTHON MFLOW_HOME="$MFLOW_E2E_LOCAL_HOME" "$MFLOW_BIN" run specs/gpt-tp2.toml "${iterations[@]}") \
    >"$STATE_DIR/local-run.out" 2>&1 || { cat "$STATE_DIR/local-run.out"; echo "the local run failed"; return 1; }
  tail -n 4 "$STATE_DIR/local-run.out"
  echo "local run: $((SECONDS - t))s"
  local here there
  here=$(stage_keys "$(ls -d "$dir"/specs/.mflow/runs/*/ | sort | tail -n 1)")
  there=$(stage_keys "$VOLUME/gpt-tp2/runs/$run")
  if [ "$here" != "$there" ]; then
    diff <(echo "$here") <(echo "$there") || true
    echo "the cluster's keys or output digests differ from the local run's (left: local)"
    return 1
  fi
  echo "$there"
}

attempt_log_of() { cat "$VOLUME/gpt-tp2/runs/$1/stages/$2/attempt-${3:-1}.log" 2>/dev/null || true; }

# TP=2 x PP=2: 4 gloo ranks in one pod, the reshards planning inserts, to the end.
case_main_job_pp2_on_kubelet() {
  prepare_train_case
  local run rec
  # 4 CPU ranks would ask for a core each, and this node has 2: the pod gets what the node has.
  run=$(run_main main_job_pp2_on_kubelet --set stages.train.pp=2 --set stages.train.resources.cpus=2)
  check_main_run "$run" 4
  rec=$(main_record "$run")
  eq "$(jq -r '.stages["train-reshard"].status' <<<"$rec")" succeeded "train-reshard"
}

# train_spec CASE NODES ITERATIONS: model, convert (TP=2), dataset and train as in
# specs/gpt-tp2.toml, on this repository's docs (copied to the volume once, so that every run
# of a case hashes the same inputs), with a checkpoint every 10 iterations. Prints its path.
train_spec() {
  local docs="$VOLUME/e2e/train-docs"
  if [ ! -d "$docs" ]; then
    mkdir -p "$docs.tmp"
    cp "$REPO_ROOT"/docs/*.md "$docs.tmp/"
    mv "$docs.tmp" "$docs"
  fi
  IMAGE=$CPU_IMAGE write_spec "$1" "train_image = \"$TRAIN_IMAGE\"" <<EOF
# The image has its own Python: the local one only enters the key, and naming it spares
# provisioning the workloads' environment here.
[env]
python = "python3"

[stages.model]
kind = "model"
source = "init:llama-tiny"
seed = 0

[stages.convert]
kind = "convert"
model = "\${stages.model.output}"
tp = 2

[stages.data]
kind = "dataset"
inputs = ["$docs/*.md"]
tokenizer = "\${stages.model.output}"
splits = "90,5,5"
seed = 7

[stages.train]
kind = "train"
model = "\${stages.convert.output}"
data = "\${stages.data.output}"
tp = 2
nodes = $2
iterations = $3
seq_length = 128
micro_batch_size = 8
global_batch_size = 16
lr = 0.003
min_lr = 0.0003
warmup_iterations = 5
save_interval = 10
eval_interval = 10
retries = { max = 1, backoff = "1s", on = ["infra"] }
EOF
}

# A checkpoint of the case's train stage is complete on the volume (the trainer writes
# `iter_NNNNNNN/meta.json` last): the point after which taking the pod away must resume.
has_checkpoint() { compgen -G "$(case_dir "$1")/wd/scratch/*/checkpoints/iter_*/meta.json" >/dev/null; }

RESUME_ITERATIONS=60

# interrupt_train CASE HOW: runs the case's spec and, once training is past its first
# checkpoint, takes the train pod away: HOW is `delete` (kubectl delete pod) or `evict` (the
# Eviction API, as a drain does). Prints mflow's output; fails unless mflow exits 0.
interrupt_train() {
  local c=$1 how=$2 spec pid pod code=0
  spec=$(train_spec "$c" 1 "$RESUME_ITERATIONS")
  "$MFLOW_BIN" run "$spec" >"$STATE_DIR/$c.out" 2>&1 &
  pid=$!
  wait_until 400 has_checkpoint "$c" || { kill "$pid"; cat "$STATE_DIR/$c.out"; return 1; }
  pod=$(kc get pods -l "mflow.dev/pipeline=$(pipeline_of "$c"),mflow.dev/stage=train" --field-selector=status.phase=Running -o jsonpath='{.items[0].metadata.name}')
  echo "taking pod $pod away ($how) after the checkpoint $(basename "$(dirname "$(compgen -G "$(case_dir "$c")/wd/scratch/*/checkpoints/iter_*/meta.json" | sort | tail -n 1)")")"
  case $how in
    delete) kc delete pod "$pod" --timeout=180s ;;
    evict)
      kc create --raw "/api/v1/namespaces/$NS/pods/$pod/eviction" -f - <<EOF
{"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "$pod", "namespace": "$NS"}}
EOF
      ;;
  esac
  wait "$pid" || code=$?
  cat "$STATE_DIR/$c.out"
  eq "$code" 0 "mflow's exit code after the pod was taken away ($how)"
}

# check_resumed CASE: attempt 1 was infra, attempt 2 resumed from the newest checkpoint of
# attempt 1 (not from 0), and its metrics start after that checkpoint.
check_resumed() {
  local c=$1 rec ck
  rec=$(record "$c")
  eq "$(jq -r '[.stages.train.attempts[].outcome] | join(",")' <<<"$rec")" "infra,success" "train attempts"
  ck=$(jq -r '.stages.train.attempts[0].checkpoint_iteration' <<<"$rec")
  [ "$ck" -gt 0 ] 2>/dev/null || { echo "attempt 1 left no checkpoint: $ck"; return 1; }
  eq "$(jq -r '.stages.train.attempts[1].resumed_from' <<<"$rec")" "$ck" "attempt 2 resumed from"
  contains "$(attempt_log "$c" train 2)" "resumed from checkpoint at iteration $ck"
  echo "$c: attempt 1 $(jq -r '.stages.train.attempts[0].message' <<<"$rec")"
  echo "$c: resumed at iteration $ck of $RESUME_ITERATIONS"
}

# The final loss and validation loss of a case's train stage, from its metrics (every attempt's).
final_losses() {
  local dir
  dir=$(ls -d "$(case_dir "$1")"/wd/runs/*/ | sort | tail -n 1)
  jq -rs '"\([.[] | select(.loss != null)] | last | .loss) \([.[] | select(.val_loss != null)] | last | .val_loss)"' "${dir}stages/train/metrics.jsonl"
}

# same_losses A B: equal within 1e-6, the resume tolerance of docs/validation.md.
same_losses() {
  awk -v a="$1" -v b="$2" 'BEGIN { split(a, x, " "); split(b, y, " ");
    for (i = 1; i <= 2; i++) { d = x[i] - y[i]; if (d < 0) d = -d; if (d > 1e-6 || x[i] == "" || x[i] == "null") exit 1 } }' ||
    { echo "losses differ: resumed $2, uninterrupted $1"; return 1; }
}

# The train pod deleted mid-training, then evicted in another run: each time the attempt is
# infra, retried, and the retry resumes from the newest checkpoint; the final losses are an
# uninterrupted run's.
case_train_pod_deleted_resumes() {
  prepare_train_case
  local base="train_pod_deleted_resumes" plain
  expect 0 mf run "$(train_spec "${base}_plain" 1 "$RESUME_ITERATIONS")"
  plain=$(final_losses "${base}_plain")
  echo "uninterrupted: final loss, val loss $plain"
  local how c
  for how in delete evict; do
    c="${base}_$how"
    interrupt_train "$c" "$how"
    contains "$(cat "$STATE_DIR/$c.out")" "attempt 2"
    check_resumed "$c"
    same_losses "$plain" "$(final_losses "$c")"
  done
}

# train with nodes = 2 (one rank per pod) on two kubelets: the pods land on two nodes and
# find each other as Trainer's runtime tells them, through the headless Service's name.
case_train_on_two_nodes_kubelet() {
  prepare_train_case
  local c=train_on_two_nodes_kubelet spec sel nodes
  trap 'bash "$E2E_DIR/cluster.sh" stop kubelet2 >/dev/null 2>&1 || true' EXIT
  bash "$E2E_DIR/cluster.sh" start kubelet2
  spec=$(train_spec "$c" 2 10)
  expect 0 mf run "$spec"
  eq "$(record "$c" | jq -r .stages.train.status)" succeeded
  sel="mflow.dev/pipeline=$(pipeline_of "$c"),mflow.dev/stage=train"
  check_torch_pods "$sel" 2 1
  nodes=$(kc get pods -l "$sel" -o jsonpath='{range .items[*]}{.spec.nodeName}{"\n"}{end}' | sort -u | tr '\n' ' ')
  eq "$nodes" "127.0.0.1 localhost " "nodes of the train pods"
}
