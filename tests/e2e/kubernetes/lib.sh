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

# drop_layer_blobs SOCKET IMAGE: once IMAGE is unpacked in the containerd at SOCKET, removes its
# layer blobs from the content store, as containerd's CRI does for pulled images with
# `discard_unpacked_layers`: containers start from the unpacked snapshots, so the layers of the
# train image (7 GB) are not on the disk twice per node. The image's manifest and config stay.
drop_layer_blobs() {
  local c=(ctr --address "$1" --namespace k8s.io) target layers digest
  "${c[@]}" images check "name==$2" | awk 'NR == 2 {exit $NF == "true" ? 0 : 1}' || return 0
  target=$("${c[@]}" images ls "name==$2" | awk 'NR == 2 {print $3}')
  [ -n "$target" ] || return 0
  layers=$("${c[@]}" content get "$target" | jq -r '.layers[]?.digest')
  for digest in $layers; do
    case $digest in
      sha256:*) "${c[@]}" content rm "$digest" >/dev/null 2>&1 || true ;;
    esac
  done
}
