#!/usr/bin/env bash
# Builds mflow's stage images from docker/Dockerfile, as users build them with `docker build`,
# but with buildah (daemonless, a Debian package) and no registry, then imports them into the
# e2e cluster's containerd when it runs (`cluster.sh up kubelet`).
#
#   images.sh [--no-import] [train] [cpu]       (default: both; root)
#
# - train: target `cpu-train` (Python, torch, the workloads, mflow), as MFLOW_E2E_TRAIN_IMAGE,
#   default localhost/mflow-cpu-train:e2e: a `train_image` that trains on CPU with gloo.
# - cpu: target `cpu` (mflow alone), as MFLOW_E2E_CPU_IMAGE, default localhost/mflow-cpu:e2e.
#
# The base (BASE) is Debian bookworm minbase made with mmdebstrap: nothing is pulled from a
# registry of images. The mflow binary is MFLOW_BIN (default target/debug/mflow), stripped, given to
# the Dockerfile with MFLOW_FROM=dist. Prints `NAME=IMAGE` lines on stdout for `eval`:
#
#   eval "$(tests/e2e/kubernetes/images.sh)"; echo "$MFLOW_E2E_TRAIN_IMAGE"
#
# Caches, under $MFLOW_E2E_CACHE/images/: buildah's storage (base image and layers: a changed
# binary rebuilds only the last layer), and per image a stamp <name>-KEY.built, KEY a digest of
# the Dockerfile, the lock, the workloads, the binary and the base, holding the ID of KEY's build.
# An unchanged image is neither rebuilt nor imported again: the imported image has the label
# mflow.dev/e2e-key=KEY. Imports stream from buildah's storage (lib.sh's import_built), so no
# archive of the image is kept on the disk. MFLOW_E2E_CONTAINERD_SOCK names another containerd
# to import into. MFLOW_E2E_BUILDAH_DRIVER picks buildah's storage driver (default overlay; vfs
# where overlay cannot mount, at the cost of a full copy per layer).
set -euo pipefail
shopt -s inherit_errexit

# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

TRAIN_IMAGE="${MFLOW_E2E_TRAIN_IMAGE:-localhost/mflow-cpu-train:e2e}"
CPU_IMAGE="${MFLOW_E2E_CPU_IMAGE:-localhost/mflow-cpu:e2e}"
BASE_IMAGE=localhost/mflow-e2e/debian:bookworm-minbase
DEBIAN_SOURCES=(
  "deb http://deb.debian.org/debian bookworm main"
  "deb http://deb.debian.org/debian bookworm-updates main"
  "deb http://deb.debian.org/debian-security bookworm-security main"
)
MFLOW_BIN="${MFLOW_BIN:-$REPO_ROOT/target/debug/mflow}"
# pip in the build trusts what this machine trusts (a proxy's CA, say); the image keeps Debian's.
CA_BUNDLE="${MFLOW_E2E_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"

import=1
targets=()
for arg in "$@"; do
  case $arg in
    --no-import) import=0 ;;
    train | cpu) targets+=("$arg") ;;
    *) die "usage: $0 [--no-import] [train] [cpu]" ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(train cpu)

for b in buildah mmdebstrap jq; do
  command -v "$b" >/dev/null || die "$b is not installed (tests/e2e/kubernetes/build.sh apt, or apt-get install buildah mmdebstrap jq)"
done
[ -x "$MFLOW_BIN" ] || die "no mflow binary at $MFLOW_BIN (cargo build, or set MFLOW_BIN)"
for t in "$TRAIN_IMAGE" "$CPU_IMAGE"; do
  case $t in localhost/*:*) ;; *) die "$t: give a localhost/NAME:TAG name (nothing is pulled or pushed)" ;; esac
  case ${t##*:} in latest) die "$t: use a tag other than latest (the kubelet would try to pull it)" ;; esac
done

mkdir -p "$IMAGES_DIR"
# One build at a time: buildah's storage and the context are shared.
exec 9>"$IMAGES_DIR/.lock"
flock 9


# stamped FILE: copies stdin to FILE, and its Dockerfile steps to stderr with their start time.
stamped() {
  local line
  while IFS= read -r line; do
    printf '%(%H:%M:%S)T %s\n' -1 "$line" >>"$1"
    case $line in *" STEP "* | *"Using cache"* | *COMMIT*) printf '%(%H:%M:%S)T   %s\n' -1 "${line:0:140}" >&2 ;; esac
  done
}

# timed LABEL CMD...: runs CMD and logs its time.
timed() {
  local label=$1 t=$SECONDS
  shift
  "$@"
  log "$label in $((SECONDS - t))s"
}

# The base: what debian:bookworm-slim is, made from Debian packages.
build_base() {
  if e2e_buildah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    log "cached: base $BASE_IMAGE"
    return 0
  fi
  local tmp ctr
  tmp=$(mktemp -d)
  # shellcheck disable=SC2064
  trap "rm -rf '$tmp'" RETURN
  mmdebstrap --quiet --variant=minbase bookworm "$tmp/rootfs.tar" "${DEBIAN_SOURCES[@]}" >&2
  ctr=$(e2e_buildah from --pull=never scratch)
  e2e_buildah add "$ctr" "$tmp/rootfs.tar" / >/dev/null
  e2e_buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd bash --os linux --arch amd64 "$ctr"
  e2e_buildah commit --quiet --rm "$ctr" "$BASE_IMAGE" >/dev/null
}

# The build context: what the Dockerfile's `cpu` and `cpu-train` targets COPY with
# MFLOW_FROM=dist, from the repository, and the binary at target/release/mflow.
CONTEXT="$IMAGES_DIR/context"
make_context() {
  rm -rf "$CONTEXT"
  mkdir -p "$CONTEXT/workloads" "$CONTEXT/target/release"
  cp -p "$REPO_ROOT/workloads/requirements.lock" "$REPO_ROOT/workloads/requirements-uv.txt" "$CONTEXT/workloads/"
  tar -C "$REPO_ROOT/workloads" --exclude=__pycache__ --exclude='*.pyc' -cf - mflow_workloads |
    tar -C "$CONTEXT/workloads" -xpf -
  # Stripped: the debug build's line tables are most of its size.
  cp "$MFLOW_BIN" "$CONTEXT/target/release/mflow"
  strip "$CONTEXT/target/release/mflow" 2>/dev/null || true
  # Same time as the binary, so that buildah's layer cache sees an unchanged one as unchanged.
  touch -r "$MFLOW_BIN" "$CONTEXT/target/release/mflow"
}

# The key of a target's image: the Dockerfile, the context's content and the base.
image_key() {
  {
    echo "target $1"
    sha256sum "$REPO_ROOT/docker/Dockerfile" | cut -d' ' -f1
    image_id "$BASE_IMAGE"
    tar -C "$CONTEXT" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - . | sha256sum
  } | sha256sum | cut -c1-16
}

# build TARGET NAME: builds the image unless KEY's build is cached; prints KEY.
build() {
  local target=$1 name=$2 key stamp id
  key=$(image_key "$target")
  stamp=$(built_stamp "$name" "$key")
  if is_built "$name" "$key"; then
    log "cached: $name ($target, key $key)"
    echo "$key"
    return 0
  fi
  # Stamps of other keys are stale, and the archives earlier versions of this script kept
  # (7 GB for the train image) are not read any more.
  rm -f "${stamp%-*}"-*.built "${stamp%-*}"-*.tar
  id=$(image_id "$name") || id=""
  local ca_args=()
  [ -f "$CA_BUNDLE" ] && ca_args=(--secret "id=pip-cert,src=$CA_BUNDLE")
  # RUN steps share the host's network (apt and pip reach their registries); chroot isolation
  # needs no user namespaces or cgroups of its own.
  local blog="$IMAGES_DIR/build-$target.log" t=$SECONDS
  : >"$blog"
  log "building $name (target $target; output in $blog)"
  e2e_buildah bud --layers --pull=never --isolation chroot --network host \
    --build-arg "BASE=$BASE_IMAGE" --build-arg MFLOW_FROM=dist "${ca_args[@]}" \
    --target "$target" -t "$name" -f "$REPO_ROOT/docker/Dockerfile" "$CONTEXT" 2>&1 | stamped "$blog" ||
    { tail -n 40 "$blog" >&2; die "building $name failed (docker/Dockerfile, target $target; log: $blog)"; }
  # buildah 1.28 leaves the container of a stage without instructions (mflow-bin) behind.
  e2e_buildah rm --all >/dev/null
  log "built $name in $((SECONDS - t))s"
  local new
  new=$(image_id "$name") || die "buildah lists no $name after building it"
  # The previous image of this name shares all but its last layers; its own go.
  if [ -n "$id" ] && [ "$id" != "$new" ]; then e2e_buildah rmi "$id" >/dev/null 2>&1 || true; fi
  echo "$new" >"$stamp.tmp"
  mv "$stamp.tmp" "$stamp"
  log "$name: $(e2e_buildah images --format '{{.Size}}' "$name" | head -n 1) unpacked"
  echo "$key"
}

# import_image NAME KEY: into the e2e containerd, unless it holds KEY's image.
import_image() {
  local name=$1 key=$2 sock="${MFLOW_E2E_CONTAINERD_SOCK:-$STATE_DIR/containerd/containerd.sock}"
  if [ ! -S "$sock" ]; then
    log "no e2e containerd at $sock (cluster.sh up kubelet); $name not imported"
    return 0
  fi
  if ctr --address "$sock" --namespace k8s.io images ls "name==$name" | grep -q "mflow.dev/e2e-key=$key"; then
    log "cached: $name in the e2e containerd"
    return 0
  fi
  local t=$SECONDS
  import_built "$sock" "$name" "$key" || die "importing $name into the containerd at $sock failed"
  log "imported $name in $((SECONDS - t))s"
}

t0=$SECONDS
timed "base image ready" build_base
make_context
for target in "${targets[@]}"; do
  case $target in
    train) name=$TRAIN_IMAGE var=MFLOW_E2E_TRAIN_IMAGE dockerfile_target=cpu-train ;;
    cpu) name=$CPU_IMAGE var=MFLOW_E2E_CPU_IMAGE dockerfile_target=cpu ;;
  esac
  key=$(build "$dockerfile_target" "$name")
  if [ "$import" = 1 ]; then import_image "$name" "$key"; fi
  echo "$var=$name"
done
log "images ready in $((SECONDS - t0))s; buildah storage $(du -sh "$IMAGES_DIR/buildah" 2>/dev/null | cut -f1)"
