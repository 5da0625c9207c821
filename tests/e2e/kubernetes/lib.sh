# shellcheck shell=bash disable=SC2034
# Versions, paths and helpers shared by build.sh, cluster.sh, image.sh and smoke.sh.

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$E2E_DIR/../../.." && pwd)"

ETCD_VERSION=v3.6.6
KUBE_VERSION=v1.36.2
TRAINER_VERSION=v2.3.0
JOBSET_VERSION=v0.12.0
KWOK_VERSION=v0.8.0

CACHE_DIR="${MFLOW_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mflow-e2e}"
STATE_DIR="${MFLOW_E2E_STATE:-/tmp/mflow-e2e}"
KUBEFLOW_DIR="${MFLOW_KUBEFLOW_DIR:-$REPO_ROOT/../shared/kubeflow}"

ETCD_BIN="$CACHE_DIR/etcd/$ETCD_VERSION/etcd"
KUBE_BIN_DIR="$CACHE_DIR/kubernetes/$KUBE_VERSION"
TRAINER_BIN="$CACHE_DIR/trainer/$TRAINER_VERSION/trainer-controller-manager"
JOBSET_BIN="$CACHE_DIR/jobset/$JOBSET_VERSION/jobset"
KWOK_BIN="$CACHE_DIR/kwok/$KWOK_VERSION/kwok"

log() { printf '%s %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }
