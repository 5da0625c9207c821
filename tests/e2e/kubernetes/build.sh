#!/usr/bin/env bash
# Builds (or reuses) everything the end-to-end cluster runs: etcd, the Kubernetes
# control plane and kubelet, kubectl, JobSet, Kubeflow Trainer and kwok from their Go
# modules, plus containerd, runc, CNI plugins and busybox from apt.
#
# Binaries are cached by version under $MFLOW_E2E_CACHE (default
# ${XDG_CACHE_HOME:-$HOME/.cache}/mflow-e2e), one directory per version, so a second
# run only checks that they exist.
#
# Usage: build.sh [apt|etcd|kubernetes|jobset|trainer|kwok]...   (default: all)
set -euo pipefail

# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# A newer toolchain would change what the binaries do (Go 1.27's JSON v2 default breaks
# the apiserver's /openapi/v2), so never let go.mod switch toolchains behind our back.
export GOTOOLCHAIN=local
GO_FLAGS=(-p 2 -trimpath)
# Go's build cache of these modules is gigabytes that no later run reads (the binaries are cached
# by version): this run's own, removed when it ends.
export GOCACHE="$CACHE_DIR/go-build.$$"
GO_LDFLAGS="-s -w"

declare -a TIMINGS=()
CURRENT=

on_exit() {
  local rc=$?
  rm -rf "$GOCACHE"
  if [ "$rc" -ne 0 ] && [ -n "$CURRENT" ]; then
    printf 'error: building %s failed (exit %d; see the output above)\n' "$CURRENT" "$rc" >&2
  fi
}
trap on_exit EXIT

# run_component NAME FUNCTION: times one component; the EXIT trap names it on failure.
run_component() {
  local start=$SECONDS
  CURRENT=$1
  log "== $1"
  "$2"
  CURRENT=
  TIMINGS+=("$(printf '%-12s %5ds' "$1" $((SECONDS - start)))")
}

need_go() {
  command -v go >/dev/null || die "go is not installed (Go 1.26 is needed)"
  local v
  v=$(go env GOVERSION)
  case $v in
    go1.26*) ;;
    *) die "Go 1.26 is needed, found $v (Go 1.27's JSON v2 default breaks kube-apiserver's /openapi/v2)" ;;
  esac
}

# finish_dir DIR: moves DIR.tmp to DIR once all its binaries are there, so an
# interrupted build never leaves a half-filled version directory behind.
finish_dir() {
  rm -rf "$1"
  mv "$1.tmp" "$1"
}

build_apt() {
  local pkgs=(containerd runc busybox-static containernetworking-plugins openssl curl jq iproute2 buildah mmdebstrap shellcheck)
  local missing=() p
  for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    log "apt packages present: ${pkgs[*]}"
    return 0
  fi
  local sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  log "installing ${missing[*]}"
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
  # The kubelet runs containerd itself, with its own config and state.
  if command -v systemctl >/dev/null && systemctl is-active --quiet containerd 2>/dev/null; then
    "${sudo[@]}" systemctl disable --now containerd || true
  fi
}

build_etcd() {
  if [ -x "$ETCD_BIN" ]; then log "cached: $ETCD_BIN"; return 0; fi
  need_go
  local src="$CACHE_DIR/src/etcd-$ETCD_VERSION" out
  out=$(dirname "$ETCD_BIN")
  mkdir -p "$src" "$out.tmp"
  # Debian's etcd 3.4 lacks the watch-progress feature a 1.36 apiserver's WatchList uses.
  cat >"$src/go.mod" <<GOMOD
module mflow-e2e/etcd

go 1.26.0

require go.etcd.io/etcd/server/v3 $ETCD_VERSION
GOMOD
  cat >"$src/main.go" <<'GOMAIN'
// etcd for the mflow end-to-end cluster: an embedded server configured from a YAML file.
package main

import (
	"flag"
	"log"
	"os"
	"os/signal"
	"syscall"

	"go.etcd.io/etcd/server/v3/embed"
)

func main() {
	configFile := flag.String("config-file", "", "etcd configuration (YAML)")
	flag.Parse()
	cfg, err := embed.ConfigFromFile(*configFile)
	if err != nil {
		log.Fatal(err)
	}
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer e.Close()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	select {
	case <-e.Server.ReadyNotify():
		log.Print("etcd is ready")
	case err := <-e.Err():
		log.Fatal(err)
	case <-sig:
		return
	}
	select {
	case err := <-e.Err():
		log.Fatal(err)
	case <-sig:
	}
}
GOMAIN
  (cd "$src" && GOFLAGS=-mod=mod go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" &&
    go build "${GO_FLAGS[@]}" -ldflags="$GO_LDFLAGS" -o "$out.tmp/etcd" .)
  finish_dir "$out"
}

build_kubernetes() {
  local bins=(kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl) b ok=1
  for b in "${bins[@]}"; do [ -x "$KUBE_BIN_DIR/$b" ] || ok=0; done
  if [ $ok = 1 ]; then log "cached: $KUBE_BIN_DIR/{${bins[*]}}"; return 0; fi
  need_go
  local src="$CACHE_DIR/src/kubernetes-$KUBE_VERSION" staging="v0${KUBE_VERSION#v1}"
  mkdir -p "$src" "$KUBE_BIN_DIR.tmp"
  # k8s.io/kubernetes requires its staging modules at v0.0.0 and points them at
  # ./staging with replace lines, which only work inside its own tree; outside it, every
  # staging module needs a replace to its published release. Take the list from the
  # kubernetes go.mod itself, so that it always matches the version.
  local kmod
  kmod=$(cd "$CACHE_DIR" && go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/^\s*"GoMod": "\(.*\)",$/\1/p')
  [ -f "$kmod" ] || die "could not download k8s.io/kubernetes@$KUBE_VERSION"
  {
    printf 'module mflow-e2e/kubernetes\n\ngo 1.26.0\n\ngodebug default=go1.26\n\n'
    printf 'require k8s.io/kubernetes %s\n\nreplace (\n' "$KUBE_VERSION"
    sed -n '/^replace (/,/^)/p' "$kmod" | awk -v v="$staging" '$2 == "=>" && $1 ~ /^k8s\.io\// { printf "\t%s => %s %s\n", $1, $1, v }'
    printf ')\n'
  } >"$src/go.mod.new"
  # go get below adds the resolved requirements to go.mod; start over only when the base
  # (the version or the staging list) changed.
  if ! cmp -s "$src/go.mod.new" "$src/go.mod.base" || [ ! -f "$src/go.mod" ]; then
    cp "$src/go.mod.new" "$src/go.mod"
    mv "$src/go.mod.new" "$src/go.mod.base"
    rm -f "$src/go.sum"
  else
    rm -f "$src/go.mod.new"
  fi
  local pkgs=() pkg ldflags=$GO_LDFLAGS minor=${KUBE_VERSION#v1.}
  minor=${minor%%.*}
  for b in "${bins[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
  # What hack/lib/version.sh stamps, so /version, node status and kubectl report the
  # real version instead of v0.0.0-master.
  for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    ldflags+=" -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  (cd "$src" &&
    GOFLAGS=-mod=mod go get "${pkgs[@]/%/@$KUBE_VERSION}" &&
    go build "${GO_FLAGS[@]}" -ldflags="$ldflags" -o "$KUBE_BIN_DIR.tmp/" "${pkgs[@]}")
  finish_dir "$KUBE_BIN_DIR"
}

# go_module_build BIN MODULE VERSION PACKAGE [LDFLAGS]: builds PACKAGE in a module of our
# own that requires only MODULE@VERSION, so the dependency set is MODULE's own. (Not
# `go install pkg@version`: it also asks the proxy for the module's version list, which a
# restricted proxy may refuse.)
go_module_build() {
  local bin=$1 mod=$2 version=$3 pkg=$4 ldflags="$GO_LDFLAGS ${5:-}" out src
  if [ -x "$bin" ]; then log "cached: $bin"; return 0; fi
  need_go
  out=$(dirname "$bin")
  src="$CACHE_DIR/src/$(basename "$(dirname "$out")")-$version"
  mkdir -p "$src" "$out.tmp"
  printf 'module mflow-e2e/%s\n\ngo 1.26.0\n\nrequire %s %s\n' "$(basename "$bin")" "$mod" "$version" >"$src/go.mod"
  (cd "$src" && GOFLAGS=-mod=mod go build "${GO_FLAGS[@]}" -ldflags="$ldflags" -o "$out.tmp/$(basename "$bin")" "$pkg")
  finish_dir "$out"
}

build_jobset() {
  go_module_build "$JOBSET_BIN" sigs.k8s.io/jobset "$JOBSET_VERSION" sigs.k8s.io/jobset \
    "-X sigs.k8s.io/jobset/pkg/version.GitVersion=$JOBSET_VERSION"
}

build_trainer() {
  go_module_build "$TRAINER_BIN" github.com/kubeflow/trainer/v2 "$TRAINER_VERSION" \
    github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager
}

build_kwok() {
  go_module_build "$KWOK_BIN" sigs.k8s.io/kwok "$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok
}

main() {
  local all=(apt etcd kwok jobset trainer kubernetes) c
  local want=("$@")
  [ ${#want[@]} -gt 0 ] || want=("${all[@]}")
  for c in "${want[@]}"; do
    case $c in
      apt | etcd | kubernetes | jobset | trainer | kwok) ;;
      *) die "unknown component '$c' (one of: ${all[*]})" ;;
    esac
  done
  mkdir -p "$CACHE_DIR"
  log "cache: $CACHE_DIR"
  local start=$SECONDS
  for c in "${want[@]}"; do run_component "$c" "build_$c"; done
  printf '%s\n' "${TIMINGS[@]}" "$(printf '%-12s %5ds' total $((SECONDS - start)))" >&2
}

main "$@"
