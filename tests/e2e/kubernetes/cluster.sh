#!/usr/bin/env bash
# A real single-node Kubernetes control plane with JobSet and Kubeflow Trainer, for mflow's
# end-to-end tests. Everything listens on 127.0.0.1 and talks only to 127.0.0.1.
#
#   cluster.sh up [kwok|kubelet]   start it (kwok: simulated node and pods, the default;
#                                  kubelet: a real kubelet with containerd and runc)
#   cluster.sh down                stop what `up` started and remove the state directory
#   cluster.sh env                 print the exports that point kubectl and tests at it
#   cluster.sh stop COMPONENT...   stop components of the running cluster (e.g. trainer)
#   cluster.sh start COMPONENT...  start them again and wait until they serve
#                                  (`start kubelet2`: a second node, see cluster-node2.sh)
#   cluster.sh sa-kubeconfig NAMESPACE NAME [FILE]
#                                  write a kubeconfig with a fresh token of a ServiceAccount
#
# State (certificates, tokens, kubeconfigs, logs, PIDs) lives in $MFLOW_E2E_STATE
# (default /tmp/mflow-e2e); binaries come from build.sh's cache.
set -euo pipefail

# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PKI="$STATE_DIR/pki"
LOGS="$STATE_DIR/logs"
PIDS="$STATE_DIR/pids"
KCFG="$STATE_DIR/kubeconfig"
CONF="$STATE_DIR/config"
MARKER="$STATE_DIR/.mflow-e2e-state"
ARTIFACTS="$STATE_DIR/artifacts"
CTRD="$STATE_DIR/containerd"
CTRD_SOCK="$CTRD/containerd.sock"
KUBECTL="$KUBE_BIN_DIR/kubectl"

API_PORT=6443
API="https://127.0.0.1:$API_PORT"
ETCD_PORT=2379
ETCD_PEER_PORT=2380
KCM_PORT=10257
SCHED_PORT=10259
KUBELET_PORT=10250
KUBELET_HEALTHZ_PORT=10248
CRI_STREAM_PORT=10010
TRAINER_WEBHOOK_PORT=9443
TRAINER_HEALTH_PORT=8091
TRAINER_METRICS_PORT=8453
JOBSET_WEBHOOK_PORT=9444
JOBSET_HEALTH_PORT=8092
JOBSET_METRICS_PORT=8454

NODE=localhost
NAMESPACE=ml
PAUSE_IMAGE=mflow-e2e/pause:1

# The cluster's DNS and the second node (started on demand).
# shellcheck source=cluster-node2.sh
. "$E2E_DIR/cluster-node2.sh"

# --- processes ----------------------------------------------------------------------------

start_time() { sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | awk '{print $20}'; }

# The PID file holds the PID and its start time, so a reused PID is never signalled.
pid_of() {
  local f="$PIDS/$1.pid" pid st
  [ -f "$f" ] || return 1
  read -r pid st <"$f" || return 1
  [ -n "$pid" ] && [ "$(start_time "$pid")" = "$st" ] || return 1
  echo "$pid"
}

alive() { pid_of "$1" >/dev/null; }

# start NAME COMMAND...: runs it in its own session (a ^C on `up` leaves it alone), logging
# to logs/NAME.log.
start() {
  local name=$1
  shift
  setsid "$@" >>"$LOGS/$name.log" 2>&1 </dev/null &
  local pid=$!
  echo "$pid $(start_time "$pid")" >"$PIDS/$name.pid"
}

# stop_pids NAME=PID:START_TIME...: TERM to all at once, then KILL what still runs after 15 s.
stop_pids() {
  local e name pid st left
  for e in "$@"; do
    name=${e%%=*} pid=${e#*=} st=${pid#*:} pid=${pid%%:*}
    [ "$(start_time "$pid")" = "$st" ] && kill -TERM "$pid" 2>/dev/null
  done
  for _ in $(seq 1 150); do
    left=0
    for e in "$@"; do
      pid=${e#*=} st=${pid#*:} pid=${pid%%:*}
      [ "$(start_time "$pid")" = "$st" ] && left=1
    done
    [ $left = 1 ] || return 0
    sleep 0.1
  done
  for e in "$@"; do
    name=${e%%=*} pid=${e#*=} st=${pid#*:} pid=${pid%%:*}
    if [ "$(start_time "$pid")" = "$st" ]; then
      log "$name ($pid) did not stop on TERM; killing it"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
}

# stop_components NAME...: stops those of them that run, together.
stop_components() {
  local c pid st list=()
  for c in "$@"; do
    [ -f "$PIDS/$c.pid" ] || continue
    read -r pid st <"$PIDS/$c.pid" || true
    [ -n "${pid:-}" ] && list+=("$c=$pid:${st:-}")
  done
  [ ${#list[@]} -eq 0 ] || stop_pids "${list[@]}"
  for c in "$@"; do rm -f "$PIDS/$c.pid"; done
}

# fail COMPONENT MESSAGE: the reason, then the end of the component's log.
fail() {
  local comp=$1
  shift
  printf 'error: %s\n' "$*" >&2
  if [ -n "$comp" ] && [ -f "$LOGS/$comp.log" ]; then
    printf -- '--- last lines of %s ---\n' "$LOGS/$comp.log" >&2
    tail -n 40 "$LOGS/$comp.log" >&2
    printf -- '---\n' >&2
  fi
  printf 'the cluster is left as it is for a look; "%s down" removes it\n' "$0" >&2
  exit 1
}

# wait_for COMPONENT SECONDS WHAT COMMAND...: polls COMMAND, failing early when the
# component has exited.
wait_for() {
  local comp=$1 timeout=$2 what=$3
  shift 3
  local deadline=$((SECONDS + timeout))
  until "$@" >/dev/null 2>&1; do
    if [ -n "$comp" ] && ! alive "$comp"; then fail "$comp" "$comp exited while waiting for $what"; fi
    [ "$SECONDS" -lt "$deadline" ] || fail "$comp" "timed out after ${timeout}s waiting for $what"
    sleep 0.3
  done
}

port_free() { ! ss -Hltn "sport = :$1" | grep -q .; }

check_ports() {
  local p
  for p in "$@"; do
    port_free "$p" || die "port 127.0.0.1:$p is already in use; stop what listens there (ss -ltnp 'sport = :$p')"
  done
}

# --- clients ------------------------------------------------------------------------------

k() { "$KUBECTL" --kubeconfig "$KCFG/admin.kubeconfig" "$@"; }

admin_token() { awk -F, '$2 == "admin" {print $1}' "$STATE_DIR/tokens.csv"; }

# get URL: an authenticated GET against the apiserver.
api_get() { curl -fsS --cacert "$PKI/ca.crt" -H "Authorization: Bearer $(admin_token)" "$API$1"; }

http_ok() { curl -fsS "$1"; }

# An HTTP answer of any status shows the TLS listener serves our certificate.
https_answers() { curl -sS -o /dev/null --cacert "$PKI/ca.crt" "$1"; }

# --- certificates, tokens, kubeconfigs ----------------------------------------------------

# sign NAME SUBJECT EXTENSIONS: an EC key and a certificate from the e2e CA.
sign() {
  local name=$1 subj=$2 ext=$3
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$PKI/$name.key" -subj "$subj" -out "$PKI/$name.csr" 2>/dev/null
  printf '%s\n' "$ext" >"$PKI/$name.ext"
  openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
    -days 30 -sha256 -extfile "$PKI/$name.ext" -out "$PKI/$name.crt" 2>/dev/null
  rm -f "$PKI/$name.csr" "$PKI/$name.ext"
}

make_pki() {
  mkdir -p "$PKI"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 30 \
    -keyout "$PKI/ca.key" -out "$PKI/ca.crt" -subj "/CN=mflow-e2e-ca" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  # One serving certificate for every loopback server: apiserver, webhooks, kubelet, kwok.
  sign serving "/CN=localhost" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,DNS:localhost"
  # The apiserver's identity towards the kubelet (logs, exec).
  sign kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$PKI/sa.key" 2>/dev/null
  openssl pkey -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub"
  chmod 600 "$PKI"/*.key
  # Where the controllers' webhook servers look for tls.crt and tls.key.
  local d
  for d in "$PKI/jobset" "$STATE_DIR/trainer-tmp/k8s-webhook-server/serving-certs"; do
    mkdir -p "$d"
    cp "$PKI/serving.crt" "$d/tls.crt"
    cp "$PKI/serving.key" "$d/tls.key"
  done
}

# kubeconfig FILE USER TOKEN
kubeconfig() {
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: mflow-e2e
  cluster:
    server: $API
    certificate-authority: $PKI/ca.crt
users:
- name: $2
  user:
    token: $3
contexts:
- name: mflow-e2e
  context:
    cluster: mflow-e2e
    user: $2
    namespace: $NAMESPACE
current-context: mflow-e2e
EOF
  chmod 600 "$1"
}

make_tokens() {
  mkdir -p "$KCFG"
  local line user token groups
  : >"$STATE_DIR/tokens.csv"
  # user|groups; "nobody" has no bindings, "mflow-user" only those of mflow's RBAC;
  # "mflow-laptop" only what a case applies from `mflow kube rbac --user mflow-laptop`.
  for line in "admin|system:masters" "nobody|" "mflow-user|" "mflow-laptop|" \
    "mflow-e2e-controllers|system:masters" "system:node:$NODE|system:nodes"; do
    user=${line%%|*}
    groups=${line#*|}
    token=$(openssl rand -hex 24)
    if [ -n "$groups" ]; then
      printf '%s,%s,%s,"%s"\n' "$token" "$user" "$user" "$groups"
    else
      printf '%s,%s,%s\n' "$token" "$user" "$user"
    fi >>"$STATE_DIR/tokens.csv"
    case $user in
      admin) kubeconfig "$KCFG/admin.kubeconfig" admin "$token" ;;
      nobody) kubeconfig "$KCFG/nobody.kubeconfig" nobody "$token" ;;
      mflow-user) kubeconfig "$KCFG/mflow-user.kubeconfig" mflow-user "$token" ;;
      mflow-laptop) kubeconfig "$KCFG/mflow-laptop.kubeconfig" mflow-laptop "$token" ;;
      mflow-e2e-controllers) kubeconfig "$KCFG/controllers.kubeconfig" controllers "$token" ;;
      system:node:*) kubeconfig "$KCFG/kubelet.kubeconfig" "system:node:$NODE" "$token" ;;
    esac
  done
  chmod 600 "$STATE_DIR/tokens.csv"
}

# sa_kubeconfig NAMESPACE NAME FILE: a kubeconfig with a 24 h token from the TokenRequest API.
sa_kubeconfig() {
  local token
  token=$(k -n "$1" create token "$2" --duration=24h)
  kubeconfig "$3" "system:serviceaccount:$1:$2" "$token"
  sed -i "s/namespace: $NAMESPACE\$/namespace: $1/" "$3"
}

# --- control plane ------------------------------------------------------------------------

start_etcd() {
  mkdir -p "$STATE_DIR/etcd"
  cat >"$CONF/etcd.yaml" <<EOF
name: mflow-e2e
data-dir: $STATE_DIR/etcd
listen-client-urls: http://127.0.0.1:$ETCD_PORT
advertise-client-urls: http://127.0.0.1:$ETCD_PORT
listen-peer-urls: http://127.0.0.1:$ETCD_PEER_PORT
initial-advertise-peer-urls: http://127.0.0.1:$ETCD_PEER_PORT
initial-cluster: mflow-e2e=http://127.0.0.1:$ETCD_PEER_PORT
initial-cluster-state: new
# A throwaway cluster: durability buys nothing, fsync costs seconds on slow disks.
unsafe-no-fsync: true
log-level: warn
logger: zap
EOF
  start etcd "$ETCD_BIN" --config-file "$CONF/etcd.yaml"
}

start_apiserver() {
  # Hostname first: the kubelet's node address that resolves to loopback is "localhost".
  start kube-apiserver "$KUBE_BIN_DIR/kube-apiserver" \
    --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port=$API_PORT \
    --etcd-servers=http://127.0.0.1:$ETCD_PORT \
    --tls-cert-file="$PKI/serving.crt" --tls-private-key-file="$PKI/serving.key" \
    --client-ca-file="$PKI/ca.crt" \
    --token-auth-file="$STATE_DIR/tokens.csv" \
    --authorization-mode=Node,RBAC \
    --anonymous-auth=false \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$PKI/sa.pub" \
    --service-account-signing-key-file="$PKI/sa.key" \
    --service-cluster-ip-range=10.96.0.0/24 \
    --endpoint-reconciler-type=none \
    --kubelet-preferred-address-types=Hostname,InternalIP \
    --kubelet-certificate-authority="$PKI/ca.crt" \
    --kubelet-client-certificate="$PKI/kubelet-client.crt" \
    --kubelet-client-key="$PKI/kubelet-client.key" \
    --allow-privileged=true \
    --profiling=false \
    --v=1
}

start_controller_manager() {
  start kube-controller-manager "$KUBE_BIN_DIR/kube-controller-manager" \
    --kubeconfig="$KCFG/controllers.kubeconfig" \
    --authentication-kubeconfig="$KCFG/controllers.kubeconfig" \
    --authorization-kubeconfig="$KCFG/controllers.kubeconfig" \
    --bind-address=127.0.0.1 --secure-port=$KCM_PORT \
    --leader-elect=false \
    --service-account-private-key-file="$PKI/sa.key" \
    --root-ca-file="$PKI/ca.crt" \
    --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
    --use-service-account-credentials=false \
    --profiling=false \
    --v=1
}

start_scheduler() {
  start kube-scheduler "$KUBE_BIN_DIR/kube-scheduler" \
    --kubeconfig="$KCFG/controllers.kubeconfig" \
    --authentication-kubeconfig="$KCFG/controllers.kubeconfig" \
    --authorization-kubeconfig="$KCFG/controllers.kubeconfig" \
    --bind-address=127.0.0.1 --secure-port=$SCHED_PORT \
    --leader-elect=false \
    --profiling=false \
    --v=1
}

start_jobset() {
  cat >"$CONF/jobset.yaml" <<EOF
apiVersion: config.jobset.x-k8s.io/v1alpha1
kind: Configuration
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
webhook:
  host: 127.0.0.1
  port: $JOBSET_WEBHOOK_PORT
  certDir: $PKI/jobset
metrics:
  bindAddress: 127.0.0.1:$JOBSET_METRICS_PORT
  certDir: $PKI/jobset
health:
  healthProbeBindAddress: 127.0.0.1:$JOBSET_HEALTH_PORT
EOF
  KUBECONFIG="$KCFG/controllers.kubeconfig" start jobset "$JOBSET_BIN" --config="$CONF/jobset.yaml"
}

start_trainer() {
  # Trainer's status server (feature gate TrainJobStatus) would listen on all interfaces.
  cat >"$CONF/trainer.yaml" <<EOF
apiVersion: config.trainer.kubeflow.org/v1alpha1
kind: Configuration
health:
  healthProbeBindAddress: 127.0.0.1:$TRAINER_HEALTH_PORT
  readinessEndpointName: readyz
  livenessEndpointName: healthz
metrics:
  bindAddress: 127.0.0.1:$TRAINER_METRICS_PORT
  secureServing: false
webhook:
  host: 127.0.0.1
  port: $TRAINER_WEBHOOK_PORT
leaderElection:
  leaderElect: false
certManagement:
  enable: false
  webhookServiceName: kubeflow-trainer-controller-manager
  webhookSecretName: kubeflow-trainer-webhook-cert
featureGates:
  TrainJobStatus: false
EOF
  # The webhook server reads its certificate from \$TMPDIR/k8s-webhook-server/serving-certs.
  KUBECONFIG="$KCFG/controllers.kubeconfig" TMPDIR="$STATE_DIR/trainer-tmp" \
    start trainer "$TRAINER_BIN" --config="$CONF/trainer.yaml"
}

# Webhook paths and rules are those of Trainer's manifests/base/webhook and JobSet's
# config/components/webhook, with a URL on loopback instead of an in-cluster Service.
register_webhooks() {
  local ca t j
  ca=$(base64 -w0 <"$PKI/ca.crt")
  t="https://127.0.0.1:$TRAINER_WEBHOOK_PORT"
  j="https://127.0.0.1:$JOBSET_WEBHOOK_PORT"
  cat >"$CONF/webhooks.yaml" <<EOF
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata:
  name: defaulter.trainer.kubeflow.org
webhooks:
- name: defaulter.trainjob.trainer.kubeflow.org
  admissionReviewVersions: [v1]
  clientConfig: {url: "$t/mutate-trainer-kubeflow-org-v1alpha1-trainjob", caBundle: "$ca"}
  failurePolicy: Fail
  sideEffects: None
  rules:
  - {apiGroups: [trainer.kubeflow.org], apiVersions: [v1alpha1], operations: [CREATE, UPDATE], resources: [trainjobs]}
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: validator.trainer.kubeflow.org
webhooks:
- name: validator.clustertrainingruntime.trainer.kubeflow.org
  admissionReviewVersions: [v1]
  clientConfig: {url: "$t/validate-trainer-kubeflow-org-v1alpha1-clustertrainingruntime", caBundle: "$ca"}
  failurePolicy: Fail
  sideEffects: None
  objectSelector:
    matchExpressions:
    - {key: trainer.kubeflow.org/webhook-validation, operator: NotIn, values: [disabled]}
  rules:
  - {apiGroups: [trainer.kubeflow.org], apiVersions: [v1alpha1], operations: [CREATE, UPDATE], resources: [clustertrainingruntimes]}
- name: validator.trainingruntime.trainer.kubeflow.org
  admissionReviewVersions: [v1]
  clientConfig: {url: "$t/validate-trainer-kubeflow-org-v1alpha1-trainingruntime", caBundle: "$ca"}
  failurePolicy: Fail
  sideEffects: None
  objectSelector:
    matchExpressions:
    - {key: trainer.kubeflow.org/webhook-validation, operator: NotIn, values: [disabled]}
  rules:
  - {apiGroups: [trainer.kubeflow.org], apiVersions: [v1alpha1], operations: [CREATE, UPDATE], resources: [trainingruntimes]}
- name: validator.trainjob.trainer.kubeflow.org
  admissionReviewVersions: [v1]
  clientConfig: {url: "$t/validate-trainer-kubeflow-org-v1alpha1-trainjob", caBundle: "$ca"}
  failurePolicy: Fail
  sideEffects: None
  rules:
  - {apiGroups: [trainer.kubeflow.org], apiVersions: [v1alpha1], operations: [CREATE, UPDATE], resources: [trainjobs]}
---
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata:
  name: jobset-mutating-webhook-configuration
webhooks:
- name: mjobset.kb.io
  admissionReviewVersions: [v1]
  clientConfig: {url: "$j/mutate-jobset-x-k8s-io-v1alpha2-jobset", caBundle: "$ca"}
  failurePolicy: Fail
  sideEffects: None
  rules:
  - {apiGroups: [jobset.x-k8s.io], apiVersions: [v1alpha2], operations: [CREATE], resources: [jobsets]}
- name: mpod.kb.io
  admissionReviewVersions: [v1]
  clientConfig: {url: "$j/mutate--v1-pod", caBundle: "$ca"}
  failurePolicy: Fail
  sideEffects: None
  objectSelector:
    matchExpressions:
    - {key: jobset.sigs.k8s.io/jobset-name, operator: Exists}
  rules:
  - {apiGroups: [""], apiVersions: [v1], operations: [CREATE], resources: [pods]}
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: jobset-validating-webhook-configuration
webhooks:
- name: vjobset.kb.io
  admissionReviewVersions: [v1]
  clientConfig: {url: "$j/validate-jobset-x-k8s-io-v1alpha2-jobset", caBundle: "$ca"}
  failurePolicy: Fail
  sideEffects: None
  rules:
  - {apiGroups: [jobset.x-k8s.io], apiVersions: [v1alpha2], operations: [CREATE, UPDATE], resources: [jobsets]}
- name: vpod.kb.io
  admissionReviewVersions: [v1]
  clientConfig: {url: "$j/validate--v1-pod", caBundle: "$ca"}
  failurePolicy: Fail
  sideEffects: None
  objectSelector:
    matchExpressions:
    - {key: jobset.sigs.k8s.io/jobset-name, operator: Exists}
  rules:
  - {apiGroups: [""], apiVersions: [v1], operations: [CREATE], resources: [pods]}
EOF
  k apply -f "$CONF/webhooks.yaml" >/dev/null
}

# --- cluster objects ----------------------------------------------------------------------

install_crds() {
  if [ ! -d "$KUBEFLOW_DIR/crds" ] || [ ! -d "$KUBEFLOW_DIR/jobset" ]; then
    die "Kubeflow data not found in $KUBEFLOW_DIR (set MFLOW_KUBEFLOW_DIR to the folder with crds/, jobset/ and runtimes/)"
  fi
  # Server-side: the Trainer CRDs are too large for the last-applied annotation.
  k apply --server-side --force-conflicts -f "$KUBEFLOW_DIR/crds" -f "$KUBEFLOW_DIR/jobset" >/dev/null
  k wait --for=condition=Established --timeout=60s \
    crd/trainjobs.trainer.kubeflow.org crd/trainingruntimes.trainer.kubeflow.org \
    crd/clustertrainingruntimes.trainer.kubeflow.org crd/jobsets.jobset.x-k8s.io >/dev/null
}

install_namespaces() {
  k apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Namespace
metadata: {name: $NAMESPACE}
---
apiVersion: v1
kind: Namespace
metadata: {name: kubeflow-system}
---
# What Trainer's release manifests publish, so that clients can read the controller version.
apiVersion: v1
kind: ConfigMap
metadata: {name: kubeflow-trainer-public, namespace: kubeflow-system}
data:
  kubeflow_trainer_version: $TRAINER_VERSION
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: kubeflow-trainer-public, namespace: kubeflow-system}
rules:
- apiGroups: [""]
  resources: [configmaps]
  resourceNames: [kubeflow-trainer-public]
  verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: kubeflow-trainer-public, namespace: kubeflow-system}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: kubeflow-trainer-public}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: Group, name: "system:authenticated"}
EOF
}

# hostnet_runtime SOURCE NAME: mflow's runtime with hostNetwork, for the kubelet node
# whose only CNI network is loopback. Its pods keep cluster DNS (ClusterFirstWithHostNet), so
# that Trainer's PET_MASTER_ADDR, a name of the JobSet's headless Service, resolves.
hostnet_runtime() {
  k create --dry-run=client -o json -f "$1" |
    jq --arg name "$2" '.metadata.name = $name
      | .metadata.labels["mflow-e2e/test-only"] = "true"
      | .spec.template.spec.replicatedJobs[].template.spec.template.spec.hostNetwork = true
      | .spec.template.spec.replicatedJobs[].template.spec.template.spec.dnsPolicy = "ClusterFirstWithHostNet"'
}

install_runtimes() {
  local ex="$REPO_ROOT/examples/kubernetes"
  hostnet_runtime "$ex/runtime-cpu.yaml" mflow-cpu-hostnet >"$CONF/mflow-cpu-hostnet.json"
  hostnet_runtime "$ex/runtime.yaml" mflow-torch-hostnet >"$CONF/mflow-torch-hostnet.json"
  # Goes through Trainer's runtime validator, so this also waits for that webhook.
  local deadline=$((SECONDS + 60))
  until k apply -f "$KUBEFLOW_DIR/runtimes" -f "$ex/runtime.yaml" -f "$ex/runtime-cpu.yaml" \
    -f "$CONF/mflow-cpu-hostnet.json" -f "$CONF/mflow-torch-hostnet.json" >"$LOGS/runtimes.log" 2>&1; do
    alive trainer || fail trainer "Trainer exited while installing the runtimes"
    [ "$SECONDS" -lt "$deadline" ] || fail runtimes "the ClusterTrainingRuntimes were not accepted within 60s"
    sleep 0.5
  done
}

install_storage() {
  mkdir -p "$ARTIFACTS"
  chmod 0777 "$ARTIFACTS"
  # A static volume bound in advance: without a provisioner the claim would stay Pending and
  # its pods Unschedulable.
  k apply -f - >/dev/null <<EOF
apiVersion: v1
kind: PersistentVolume
metadata:
  name: mflow-e2e-artifacts
  labels: {app.kubernetes.io/managed-by: mflow}
spec:
  capacity: {storage: 200Gi}
  accessModes: [ReadWriteMany]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: ""
  claimRef: {namespace: $NAMESPACE, name: mflow-artifacts}
  hostPath: {path: $ARTIFACTS, type: Directory}
EOF
  k -n "$NAMESPACE" apply -f "$REPO_ROOT/examples/kubernetes/pvc.yaml" >/dev/null
}

install_rbac() {
  local rbac="$REPO_ROOT/examples/kubernetes/rbac.yaml" roles croles r
  k apply -f "$rbac" >/dev/null
  # The same grants for the user mflow-user, which stands for mflow run from a laptop.
  roles=$(k create --dry-run=client -o json -f "$rbac" | jq -r '.items[]? // . | select(.kind == "Role") | .metadata.name')
  croles=$(k create --dry-run=client -o json -f "$rbac" | jq -r '.items[]? // . | select(.kind == "ClusterRole") | .metadata.name')
  for r in $roles; do
    k -n "$NAMESPACE" create rolebinding "mflow-e2e-user-$r" --role="$r" --user=mflow-user \
      --dry-run=client -o yaml | k apply -f - >/dev/null
  done
  for r in $croles; do
    k create clusterrolebinding "mflow-e2e-user-$r" --clusterrole="$r" --user=mflow-user \
      --dry-run=client -o yaml | k apply -f - >/dev/null
  done
}

# A TrainJob that only the webhooks can refuse, accepted once Trainer and JobSet answer.
probe_trainjob() {
  k -n "$NAMESPACE" create --dry-run=server -f - <<EOF
apiVersion: trainer.kubeflow.org/v1alpha1
kind: TrainJob
metadata: {name: mflow-e2e-probe}
spec:
  runtimeRef: {name: mflow-cpu-hostnet}
  trainer: {image: $PAUSE_IMAGE, command: [sh, -c, "true"]}
EOF
}

probe_jobset() {
  k -n "$NAMESPACE" create --dry-run=server -f - <<EOF
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata: {name: mflow-e2e-probe}
spec:
  replicatedJobs:
  - name: node
    template:
      spec:
        template:
          spec:
            restartPolicy: Never
            containers: [{name: node, image: $PAUSE_IMAGE}]
EOF
}

# --- nodes --------------------------------------------------------------------------------

start_kwok() {
  mkdir -p "$STATE_DIR/kwok"
  # What `kubectl logs` shows for a kwok pod's container "node" (CRI log format).
  printf '%s stdout F mflow-e2e: log line served by kwok\n' "$(date -u +%Y-%m-%dT%H:%M:%S.000000000Z)" \
    >"$STATE_DIR/kwok/node.log"
  cat >"$CONF/kwok.yaml" <<EOF
apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  # Every node annotated as kwok's: $NODE, and the fake nodes a case adds.
  manageNodesWithAnnotationSelector: kwok.x-k8s.io/node=fake
  nodeName: $NODE
  nodeIP: 127.0.0.1
  nodePort: $KUBELET_PORT
  serverAddress: 127.0.0.1:$KUBELET_PORT
  tlsCertFile: $PKI/serving.crt
  tlsPrivateKeyFile: $PKI/serving.key
  nodeLeaseDurationSeconds: 40
  # Serves pods/log (ClusterLogs below); the handlers are off by default.
  enableDebuggingHandlers: true
  # kwok leaves these at 0 when read from a file, and refuses to start then.
  nodeLeaseParallelism: 2
  podPlayStageParallelism: 4
  nodePlayStageParallelism: 2
  podsOnNodeSyncParallelism: 1
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: ClusterLogs
metadata: {name: mflow-e2e}
spec:
  selector: {}
  logs:
  - containers: [node]
    logsFile: $STATE_DIR/kwok/node.log
    follow: false
EOF
  # Capacity like a GPU node, so that scheduling never limits the simulated stages.
  k apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata:
  name: $NODE
  labels:
    kubernetes.io/hostname: $NODE
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    type: kwok
    mflow-e2e/mode: kwok
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
status:
  capacity: {cpu: "32", memory: 256Gi, pods: "110", nvidia.com/gpu: "8", ephemeral-storage: 1Ti}
  allocatable: {cpu: "32", memory: 256Gi, pods: "110", nvidia.com/gpu: "8", ephemeral-storage: 1Ti}
EOF
  start kwok "$KWOK_BIN" --kubeconfig="$KCFG/controllers.kubeconfig" \
    --config="$CONF/kwok.yaml" --config="$E2E_DIR/kwok-stages.yaml"
}

# start_containerd [NAME DIR STREAM_PORT]: a containerd with its root, state and socket in DIR
# (the first node's by default; the second node has its own, see cluster-node2.sh).
start_containerd() {
  local name=${1:-containerd} dir=${2:-$CTRD} stream_port=${3:-$CRI_STREAM_PORT}
  local sock="$dir/containerd.sock"
  mkdir -p "$dir/root" "$dir/state" "$dir/opt" "$STATE_DIR/cni/net.d"
  # The only network is loopback: stage pods use hostNetwork, and CRI needs a network to
  # report NetworkReady.
  cat >"$STATE_DIR/cni/net.d/10-loopback.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "mflow-e2e", "plugins": [{"type": "loopback"}]}
EOF
  local cni_bin=/usr/lib/cni
  [ -x "$cni_bin/loopback" ] || cni_bin=/opt/cni/bin
  # restrict_oom_score_adj: on VMs where root may not lower oom_score_adj, runc fails with
  # "can't get final child's PID from pipe: EOF" otherwise.
  cat >"$CONF/$name.toml" <<EOF
version = 2
root = "$dir/root"
state = "$dir/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "$sock"

[ttrpc]
  address = "$sock.ttrpc"

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "$dir/opt"

[plugins."io.containerd.grpc.v1.cri"]
  restrict_oom_score_adj = true
  sandbox_image = "docker.io/$PAUSE_IMAGE"
  stream_server_address = "127.0.0.1"
  stream_server_port = "$stream_port"
  enable_selinux = false
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$dir/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$cni_bin"
    conf_dir = "$STATE_DIR/cni/net.d"
EOF
  start "$name" containerd --config "$CONF/$name.toml"
}

ctr_() { ctr --address "$CTRD_SOCK" --namespace k8s.io "$@"; }

# The sandbox ("pause") container: busybox sleeping until told to stop.
import_pause_image() {
  "$E2E_DIR/image.sh" --no-import \
    --entrypoint '["/bin/sh","-c","trap \"exit 0\" TERM INT; while :; do sleep 3600 & wait $!; done"]' \
    "$PAUSE_IMAGE" >"$LOGS/pause-image.log" 2>&1 || fail pause-image "building the pause image failed"
  local archive
  archive=$(tail -n 1 "$LOGS/pause-image.log")
  ctr_ images import "$archive" >>"$LOGS/pause-image.log" 2>&1 ||
    fail pause-image "importing the pause image failed"
}

# start_kubelet [NAME NODE PORT HEALTHZ_PORT CONTAINERD_SOCK POD_LOGS]: a kubelet with its
# root in $STATE_DIR/NAME (the first node's by default; see cluster-node2.sh for the second).
start_kubelet() {
  local name=${1:-kubelet} node=${2:-$NODE} port=${3:-$KUBELET_PORT} healthz=${4:-$KUBELET_HEALTHZ_PORT}
  local sock=${5:-$CTRD_SOCK} pod_logs=${6:-$STATE_DIR/pod-logs}
  mkdir -p "$STATE_DIR/$name" "$pod_logs"
  # This VM has cgroup v1 only and no systemd: cgroupfs, no QoS cgroups, no eviction, and
  # no image GC (images are imported, never pulled back). Pods that ask for cluster DNS
  # (the hostnet runtimes: ClusterFirstWithHostNet) get the suite's DNS on 127.0.0.1.
  cat >"$CONF/$name.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: $port
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $healthz
tlsCertFile: $PKI/serving.crt
tlsPrivateKeyFile: $PKI/serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix://$sock
imageServiceEndpoint: unix://$sock
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
evictionHard: {}
evictionSoft: {}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
podLogsDir: $pod_logs
volumePluginDir: $STATE_DIR/$name/volume-plugins
serializeImagePulls: false
rotateCertificates: false
serverTLSBootstrap: false
resolvConf: /etc/resolv.conf
clusterDNS: [127.0.0.1]
clusterDomain: cluster.local
maxPods: 110
EOF
  local kcfg="$KCFG/kubelet.kubeconfig"
  [ "$name" = kubelet ] || kcfg="$KCFG/$name.kubeconfig"
  start "$name" "$KUBE_BIN_DIR/kubelet" \
    --config="$CONF/$name.yaml" \
    --kubeconfig="$kcfg" \
    --root-dir="$STATE_DIR/$name" \
    --hostname-override="$node" \
    --node-labels=mflow-e2e/mode=kubelet \
    --v=2
}

# node_ready [NODE]
node_ready() {
  [ "$(k get node "${1:-$NODE}" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]
}

# --- down ---------------------------------------------------------------------------------

# stop_containers [NAME SOCKET]: pods outlive containerd in their shims; stop them while
# containerd still answers, then stop the shims of this containerd that remain.
stop_containers() {
  local name=${1:-containerd} sock=${2:-$CTRD_SOCK}
  [ -S "$sock" ] || return 0
  if alive "$name"; then
    local ids id ctr_=(ctr --address "$sock" --namespace k8s.io)
    ids=$("${ctr_[@]}" tasks ls -q 2>/dev/null || true)
    for id in $ids; do "${ctr_[@]}" tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true; done
    for id in $ids; do
      "${ctr_[@]}" tasks delete -f "$id" >/dev/null 2>&1 || true
      "${ctr_[@]}" containers delete "$id" >/dev/null 2>&1 || true
    done
  fi
  local p cmd shims=()
  for p in /proc/[0-9]*; do
    cmd=$(tr '\0' ' ' <"$p/cmdline" 2>/dev/null) || continue
    case $cmd in
      *containerd-shim*"-address $sock "*) shims+=("containerd-shim=${p#/proc/}:$(start_time "${p#/proc/}")") ;;
    esac
  done
  [ ${#shims[@]} -eq 0 ] || stop_pids "${shims[@]}"
}

# unmount_state [PREFIX]: what is mounted below the state directory (or PREFIX).
unmount_state() {
  local m prefix=${1:-$STATE_DIR/}
  # Deepest first.
  findmnt -rn -o TARGET | { grep -F "$prefix" || true; } | awk '{print length, $0}' | sort -rn | cut -d' ' -f2- |
    while read -r m; do
      umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "could not unmount $m"
    done
}

down() {
  [ -d "$STATE_DIR" ] || return 0
  [ -f "$MARKER" ] || die "$STATE_DIR is not an mflow e2e state directory; not touching it"
  # Clients of the apiserver first, then it, then etcd; containerd after its containers.
  stop_components kwok kubelet kubelet2 dns trainer jobset kube-scheduler kube-controller-manager
  stop_components kube-apiserver
  stop_components etcd
  stop_containers
  stop_containers containerd2 "$CTRD2_SOCK"
  stop_components containerd containerd2
  unmount_state
  # The kubelet links container logs into /var/log/containers; drop the links into our state.
  local l
  for l in /var/log/containers/*.log; do
    [ -L "$l" ] && case $(readlink "$l") in "$STATE_DIR"/*) rm -f "$l" ;; esac
  done
  rm -rf "$STATE_DIR"
}

# --- up -----------------------------------------------------------------------------------

need_bins() {
  local b
  for b in "$ETCD_BIN" "$KUBE_BIN_DIR/kube-apiserver" "$KUBE_BIN_DIR/kube-controller-manager" \
    "$KUBE_BIN_DIR/kube-scheduler" "$KUBECTL" "$TRAINER_BIN" "$JOBSET_BIN" "$@"; do
    [ -x "$b" ] || die "$b is missing; run $E2E_DIR/build.sh first"
  done
  for b in openssl curl jq ss findmnt; do
    command -v "$b" >/dev/null || die "$b is not installed"
  done
}

up() {
  local mode=${1:-kwok} start=$SECONDS
  case $mode in
    kwok) need_bins "$KWOK_BIN" ;;
    kubelet)
      need_bins "$KUBE_BIN_DIR/kubelet"
      [ "$(id -u)" -eq 0 ] || die "mode kubelet runs containers and needs root"
      local b
      for b in containerd runc ctr busybox; do command -v "$b" >/dev/null || die "$b is not installed; run build.sh"; done
      ;;
    *) die "unknown mode '$mode' (kwok or kubelet)" ;;
  esac
  case $STATE_DIR in /* ) ;; *) die "MFLOW_E2E_STATE must be an absolute path" ;; esac
  case $STATE_DIR in *[[:space:]]*) die "MFLOW_E2E_STATE must not contain spaces" ;; esac

  if [ -d "$STATE_DIR" ]; then
    log "stopping the previous cluster in $STATE_DIR"
    down
  fi
  local ports=("$ETCD_PORT" "$ETCD_PEER_PORT" "$API_PORT" "$KCM_PORT" "$SCHED_PORT" "$KUBELET_PORT"
    "$TRAINER_WEBHOOK_PORT" "$TRAINER_HEALTH_PORT" "$TRAINER_METRICS_PORT"
    "$JOBSET_WEBHOOK_PORT" "$JOBSET_HEALTH_PORT" "$JOBSET_METRICS_PORT")
  [ "$mode" = kubelet ] && ports+=("$KUBELET_HEALTHZ_PORT" "$CRI_STREAM_PORT")
  check_ports "${ports[@]}"
  [ "$mode" = kubelet ] && check_dns_port

  mkdir -p "$STATE_DIR" "$LOGS" "$PIDS" "$KCFG" "$CONF"
  touch "$MARKER"
  echo "$mode" >"$STATE_DIR/mode"
  make_pki
  make_tokens

  log "starting etcd and kube-apiserver"
  [ "$mode" = kubelet ] && start_containerd
  start_etcd
  wait_for etcd 30 "etcd /health" curl -fsS "http://127.0.0.1:$ETCD_PORT/health"
  start_apiserver
  wait_for kube-apiserver 60 "kube-apiserver /readyz" api_get /readyz
  log "apiserver ready after $((SECONDS - start))s"
  start_controller_manager
  start_scheduler

  install_crds
  install_namespaces
  start_jobset
  start_trainer
  if [ "$mode" = kubelet ]; then
    wait_for containerd 30 "the containerd socket" ctr_ version
    import_pause_image
    start_dns
    start_kubelet
  else
    start_kwok
  fi
  wait_for jobset 60 "JobSet readyz" http_ok "http://127.0.0.1:$JOBSET_HEALTH_PORT/readyz"
  wait_for trainer 60 "Trainer readyz" http_ok "http://127.0.0.1:$TRAINER_HEALTH_PORT/readyz"
  wait_for jobset 30 "JobSet webhook TLS" https_answers "https://127.0.0.1:$JOBSET_WEBHOOK_PORT/validate-jobset-x-k8s-io-v1alpha2-jobset"
  wait_for trainer 30 "Trainer webhook TLS" https_answers "https://127.0.0.1:$TRAINER_WEBHOOK_PORT/validate-trainer-kubeflow-org-v1alpha1-trainjob"
  register_webhooks
  install_runtimes
  install_storage
  install_rbac
  wait_for jobset 30 "JobSet webhooks through the apiserver" probe_jobset
  wait_for trainer 30 "Trainer webhooks through the apiserver" probe_trainjob

  local node_comp=kwok
  [ "$mode" = kubelet ] && node_comp=kubelet
  wait_for "$node_comp" 90 "node $NODE Ready" node_ready
  wait_for kube-controller-manager 30 "claim mflow-artifacts Bound" \
    test "$(k -n "$NAMESPACE" get pvc mflow-artifacts -o jsonpath='{.status.phase}' 2>/dev/null)" = Bound
  wait_for kube-controller-manager 30 "ServiceAccount $NAMESPACE/default" k -n "$NAMESPACE" get serviceaccount default
  sa_kubeconfig "$NAMESPACE" mflow "$KCFG/sa-mflow.kubeconfig"
  write_env "$mode"
  log "cluster up ($mode) in $((SECONDS - start))s"
  cat "$STATE_DIR/env"
}

write_env() {
  cat >"$STATE_DIR/env" <<EOF
export MFLOW_E2E_STATE=$STATE_DIR
export MFLOW_E2E_MODE=$1
export KUBECONFIG=$KCFG/admin.kubeconfig
export MFLOW_E2E_KUBECONFIG_ADMIN=$KCFG/admin.kubeconfig
export MFLOW_E2E_KUBECONFIG_NOBODY=$KCFG/nobody.kubeconfig
export MFLOW_E2E_KUBECONFIG_USER=$KCFG/mflow-user.kubeconfig
export MFLOW_E2E_KUBECONFIG_SA=$KCFG/sa-mflow.kubeconfig
export MFLOW_E2E_NAMESPACE=$NAMESPACE
export MFLOW_E2E_ARTIFACTS=$ARTIFACTS
export MFLOW_E2E_CONTAINERD_SOCK=$CTRD_SOCK
export PATH=$KUBE_BIN_DIR:\$PATH
EOF
}

COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler jobset trainer kwok containerd kubelet dns kubelet2)

# start_again COMPONENT: starts one stopped component of the running cluster and waits until
# it serves again (tests use it to take a controller away and bring it back).
start_again() {
  local c=$1 mode
  mode=$(cat "$STATE_DIR/mode")
  if alive "$c"; then
    log "$c is running"
    return 0
  fi
  case $c in
    kube-apiserver)
      start_apiserver
      wait_for kube-apiserver 60 "kube-apiserver /readyz" api_get /readyz
      ;;
    kube-controller-manager) start_controller_manager ;;
    kube-scheduler) start_scheduler ;;
    jobset)
      start_jobset
      wait_for jobset 60 "JobSet readyz" http_ok "http://127.0.0.1:$JOBSET_HEALTH_PORT/readyz"
      ;;
    trainer)
      start_trainer
      wait_for trainer 60 "Trainer readyz" http_ok "http://127.0.0.1:$TRAINER_HEALTH_PORT/readyz"
      ;;
    kwok | kubelet)
      [ "$c" = "$mode" ] || die "this cluster runs in mode $mode; $c is not part of it"
      "start_$c"
      wait_for "$c" 90 "node $NODE Ready" node_ready
      ;;
    dns)
      [ "$mode" = kubelet ] || die "the DNS serves the kubelet's pods; this cluster runs in mode $mode"
      start_dns
      ;;
    kubelet2)
      [ "$mode" = kubelet ] || die "a second kubelet joins a cluster in mode kubelet; this one runs in mode $mode"
      start_node2
      ;;
    *) die "$c cannot be restarted on its own (one of: kube-controller-manager kube-scheduler jobset trainer kwok kubelet dns kubelet2)" ;;
  esac
  log "$c started"
}

need_cluster() { [ -f "$STATE_DIR/env" ] || die "no cluster in $STATE_DIR; run $0 up"; }

main() {
  local cmd=${1:-}
  [ $# -gt 0 ] && shift
  case $cmd in
    up) up "$@" ;;
    down)
      down
      log "cluster down"
      ;;
    env)
      need_cluster
      cat "$STATE_DIR/env"
      ;;
    stop)
      need_cluster
      [ $# -ge 1 ] || die "usage: $0 stop COMPONENT..."
      local c
      for c in "$@"; do
        case " ${COMPONENTS[*]} " in *" $c "*) ;; *) die "unknown component $c (one of: ${COMPONENTS[*]})" ;; esac
      done
      local rest=()
      for c in "$@"; do
        if [ "$c" = kubelet2 ]; then stop_node2; else rest+=("$c"); fi
      done
      [ ${#rest[@]} -eq 0 ] || stop_components "${rest[@]}"
      log "stopped $*"
      ;;
    start)
      need_cluster
      [ $# -ge 1 ] || die "usage: $0 start COMPONENT..."
      local c
      for c in "$@"; do start_again "$c"; done
      ;;
    sa-kubeconfig)
      [ $# -ge 2 ] || die "usage: $0 sa-kubeconfig NAMESPACE NAME [FILE]"
      sa_kubeconfig "$1" "$2" "${3:-$KCFG/sa-$1-$2.kubeconfig}"
      echo "${3:-$KCFG/sa-$1-$2.kubeconfig}"
      ;;
    *) die "usage: $0 up [kwok|kubelet] | down | env | stop COMPONENT... | start COMPONENT... | sa-kubeconfig NAMESPACE NAME [FILE]" ;;
  esac
}

main "$@"
