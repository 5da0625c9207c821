#!/usr/bin/env bash
# Builds a container image from files on this machine, with no registry and no Docker: an
# OCI image archive holding busybox (as /bin/sh and its applets), the given files and the
# shared libraries they need, then imports it into the e2e cluster's containerd.
#
#   image.sh [--no-import] [--entrypoint JSON] NAME:TAG [FILE | SRC=DEST]...
#
# FILE goes to /usr/local/bin/<its name>; SRC=DEST copies a file or directory to the
# absolute path DEST. The archive is written to $MFLOW_E2E_CACHE/images/ and its path is
# the last line printed. Example, for a stage image with the mflow binary:
#
#   image.sh mflow-e2e/mflow:dev target/release/mflow
#
# Use a tag other than "latest": the kubelet would try to pull a :latest image.
set -euo pipefail

# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() { die "usage: $0 [--no-import] [--entrypoint JSON] NAME:TAG [FILE | SRC=DEST]..."; }

import=1
entrypoint=null
while [ $# -gt 0 ]; do
  case $1 in
    --no-import) import=0 ;;
    --entrypoint)
      [ $# -ge 2 ] || usage
      entrypoint=$2
      shift
      ;;
    --) shift; break ;;
    -*) usage ;;
    *) break ;;
  esac
  shift
done
[ $# -ge 1 ] || usage
name=$1
shift
case $name in *:*) ;; *) die "give the image a tag: $name:TAG" ;; esac
case ${name##*:} in latest) die "use a tag other than latest (the kubelet would try to pull it)" ;; esac
echo "$entrypoint" | jq -e 'type == "array" or . == null' >/dev/null || die "--entrypoint must be a JSON array"

# The name the kubelet asks containerd for: "a/b:t" means docker.io/a/b:t.
ref=$name
first=${ref%%/*}
if [ "$first" = "$ref" ]; then
  ref="docker.io/library/$ref"
elif ! case $first in *.* | *:* | localhost) true ;; *) false ;; esac then
  ref="docker.io/$ref"
fi

busybox=$(command -v busybox) || die "busybox is not installed (apt-get install busybox-static)"
case $(ldd "$busybox" 2>&1 || true) in *"not a dynamic"*) ;; *)
  die "$busybox is not statically linked (apt-get install busybox-static)" ;;
esac

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root="$work/rootfs"
mkdir -p "$root/bin" "$root/usr/bin" "$root/usr/local/bin" "$root/etc" "$root/tmp" "$root/root"
chmod 1777 "$root/tmp"
cp "$busybox" "$root/bin/busybox"
for applet in $("$busybox" --list); do
  [ -e "$root/bin/$applet" ] || ln -s busybox "$root/bin/$applet"
done
ln -s ../../bin/env "$root/usr/bin/env"
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$root/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$root/etc/group"

# copy_libs FILE: the shared libraries FILE loads, at the paths the loader looks for them.
copy_libs() {
  local lib
  ldd "$1" 2>/dev/null | awk '/=> \// {print $3} /^[ \t]*\// {print $1}' | while read -r lib; do
    [ -e "$root$lib" ] && continue
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
  done
}

for arg in "$@"; do
  case $arg in
    *=*) src=${arg%%=*} dest=${arg#*=} ;;
    *) src=$arg dest=/usr/local/bin/$(basename "$arg") ;;
  esac
  [ -e "$src" ] || die "$src does not exist"
  case $dest in /*) ;; *) die "destination $dest must be absolute" ;; esac
  mkdir -p "$root$(dirname "$dest")"
  cp -rL "$src" "$root$dest"
  if [ -d "$src" ]; then
    while IFS= read -r -d '' f; do copy_libs "$f"; done < <(find "$src" -type f -perm -u+x -print0)
  else
    copy_libs "$src"
  fi
done

# OCI image layout: one uncompressed layer, reproducible (sorted, owned by root, time 0).
oci="$work/oci"
mkdir -p "$oci/blobs/sha256"
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$root" -cf "$work/layer.tar" .
blob() { # FILE -> digest; stores FILE as a blob
  local d
  d=$(sha256sum "$1" | cut -d' ' -f1)
  mv "$1" "$oci/blobs/sha256/$d"
  echo "$d"
}
layer_size=$(stat -c %s "$work/layer.tar")
layer=$(blob "$work/layer.tar")
jq -cn --arg layer "sha256:$layer" --argjson entrypoint "$entrypoint" '{
  architecture: "amd64", os: "linux",
  config: ({Env: ["PATH=/usr/local/bin:/usr/bin:/bin"], Cmd: ["/bin/sh"], WorkingDir: "/"}
    + (if $entrypoint then {Entrypoint: $entrypoint, Cmd: null} else {} end)),
  rootfs: {type: "layers", diff_ids: [$layer]},
  history: [{created_by: "mflow tests/e2e/kubernetes/image.sh"}]
}' >"$work/config.json"
config_size=$(stat -c %s "$work/config.json")
config=$(blob "$work/config.json")
jq -cn --arg config "sha256:$config" --argjson csize "$config_size" \
  --arg layer "sha256:$layer" --argjson lsize "$layer_size" '{
  schemaVersion: 2,
  mediaType: "application/vnd.oci.image.manifest.v1+json",
  config: {mediaType: "application/vnd.oci.image.config.v1+json", digest: $config, size: $csize},
  layers: [{mediaType: "application/vnd.oci.image.layer.v1.tar", digest: $layer, size: $lsize}]
}' >"$work/manifest.json"
manifest_size=$(stat -c %s "$work/manifest.json")
manifest=$(blob "$work/manifest.json")
jq -cn --arg manifest "sha256:$manifest" --argjson size "$manifest_size" --arg ref "$ref" --arg tag "${name##*:}" '{
  schemaVersion: 2,
  mediaType: "application/vnd.oci.image.index.v1+json",
  manifests: [{
    mediaType: "application/vnd.oci.image.manifest.v1+json", digest: $manifest, size: $size,
    platform: {architecture: "amd64", os: "linux"},
    annotations: {"io.containerd.image.name": $ref, "org.opencontainers.image.ref.name": $tag}
  }]
}' >"$oci/index.json"
printf '{"imageLayoutVersion":"1.0.0"}' >"$oci/oci-layout"

mkdir -p "$CACHE_DIR/images"
out="$CACHE_DIR/images/$(echo "$name" | tr '/:' '__').tar"
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$oci" -cf "$out.tmp" .
mv "$out.tmp" "$out"
log "built $ref ($(du -h "$out" | cut -f1))"

if [ "$import" = 1 ]; then
  sock="$STATE_DIR/containerd/containerd.sock"
  if [ -S "$sock" ]; then
    ctr --address "$sock" --namespace k8s.io images import "$out" >&2
    log "imported $ref into the e2e containerd"
  else
    log "no e2e containerd at $sock (cluster.sh up kubelet); not imported"
  fi
fi
echo "$out"
