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

IMAGES_DIR="$CACHE_DIR/images"

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

# e2e_buildah ARGS...: buildah on the storage of images.sh.
e2e_buildah() {
  buildah --root "$IMAGES_DIR/buildah" --runroot "${XDG_RUNTIME_DIR:-/run}/mflow-e2e-buildah" \
    --storage-driver "${MFLOW_E2E_BUILDAH_DRIVER:-overlay}" "$@"
}

# built_stamp NAME KEY: the file by which images.sh records that buildah's NAME is KEY's build.
built_stamp() { echo "$IMAGES_DIR/$(echo "${1#localhost/}" | tr '/:' '__')-$2.built"; }

# image_id NAME: the ID of buildah's image NAME; fails when there is none.
image_id() { e2e_buildah inspect --type image --format '{{.FromImageID}}' "$1" 2>/dev/null; }

# is_built NAME KEY: whether buildah's NAME is KEY's build (the ID in its stamp).
is_built() {
  local stamp id
  stamp=$(built_stamp "$1" "$2")
  [ -f "$stamp" ] && id=$(image_id "$1") && [ "$(cat "$stamp")" = "$id" ]
}

# has_room_for NAME: whether the state directory's disk holds NAME's import: its layers in the
# content store and unpacked beside them, until the blobs go. Says so plainly when it does not,
# rather than leaving containerd's "no space left on device" halfway through a layer.
has_room_for() {
  local name=$1 size need avail
  size=$(e2e_buildah images --format '{{.Size}}' "$name" | head -n 1 | tr -d ' B' | tr k K)
  size=$(numfmt --from=si "$size" 2>/dev/null) || return 0
  need=$((2 * size + (1 << 30)))
  avail=$(df --output=avail -B1 "$STATE_DIR" | tail -n 1)
  [ "$avail" -ge "$need" ] && return 0
  log "importing $name needs about $(numfmt --to=si "$need")B free on the disk of $STATE_DIR; it has $(numfmt --to=si "$avail")B"
  return 1
}

# import_built SOCKET NAME KEY: streams NAME, which is_built as KEY's build, from buildah's
# storage into the containerd at SOCKET, in `docker save`'s format through a pipe (no archive
# on the disk: the train image is 7 GB), labels it mflow.dev/e2e-key=KEY and drops its layer
# blobs.
import_built() {
  local sock=$1 name=$2 key=$3 c=(ctr --address "$1" --namespace k8s.io)
  has_room_for "$name" || return 1
  # Layers uncompressed: gzip of gigabytes of CUDA libraries takes minutes on 2 cores.
  # --base-name: ctr keeps the archive's own name only when it starts with this.
  e2e_buildah push --quiet --disable-compression "$name" "docker-archive:/dev/stdout:$name" |
    "${c[@]}" images import --base-name "${name%:*}" - >&2 || return 1
  "${c[@]}" images label "$name" "mflow.dev/e2e-key=$key" >/dev/null || return 1
  drop_layer_blobs "$sock" "$name"
}
