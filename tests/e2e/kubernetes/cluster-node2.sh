# shellcheck shell=bash
# Sourced by cluster.sh: the cluster's DNS (mode kubelet) and a second kubelet, started only on
# demand (`cluster.sh start kubelet2`, `cluster.sh stop kubelet2`), so that a TrainJob of two
# nodes runs one pod on each.
#
# Both nodes are this machine. Their stage pods use the host network (Trainer declares port
# 29500, so two of them cannot share a node), and a pod's address on this machine is 127.0.0.1.
# The DNS answers the names of a headless Service's pods, as cluster DNS does, with that address:
# Trainer's PET_MASTER_ADDR `<trainjob>-node-0-0.<trainjob>` resolves (see dns/main.go).

DNS_SRC="$E2E_DIR/dns"
DNS_PORT=53
# The node's name is its address: the apiserver reaches a kubelet by its Hostname address
# (--kubelet-preferred-address-types), which must be 127.0.0.1 without an /etc/hosts entry.
NODE2=127.0.0.1
KUBELET2_PORT=10260
KUBELET2_HEALTHZ_PORT=10261
CRI2_STREAM_PORT=10011
# A containerd of its own: a kubelet kills the running pods of its runtime that are not bound
# to its node, so two kubelets cannot share one.
CTRD2="$STATE_DIR/containerd2"
CTRD2_SOCK="$CTRD2/containerd.sock"

dns_listening() { ss -Hlun "sport = :$DNS_PORT" | grep -q .; }

check_dns_port() {
  ! dns_listening || die "udp port 127.0.0.1:$DNS_PORT is already in use; stop what listens there (ss -lunp 'sport = :$DNS_PORT')"
}

# dns_bin: the DNS, built on first use (Go standard library only), cached by its source.
dns_bin() {
  local sum dir
  sum=$(cat "$DNS_SRC/go.mod" "$DNS_SRC/main.go" | sha256sum | cut -c1-16)
  dir="$CACHE_DIR/dns/$sum"
  if [ ! -x "$dir/mflow-e2e-dns" ]; then
    command -v go >/dev/null || die "go is needed to build the cluster's DNS from $DNS_SRC"
    rm -rf "$dir.tmp"
    mkdir -p "$dir.tmp"
    (cd "$DNS_SRC" && GOTOOLCHAIN=local CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o "$dir.tmp/mflow-e2e-dns" .) >&2 ||
      die "building the DNS from $DNS_SRC failed"
    rm -rf "$dir"
    mv "$dir.tmp" "$dir"
  fi
  echo "$dir/mflow-e2e-dns"
}

# start_dns: reads Services and pods as the controllers do; its log names every answer.
start_dns() {
  local bin
  bin=$(dns_bin)
  mkdir -p "$STATE_DIR/dns"
  (umask 077 && awk -F, '$2 == "mflow-e2e-controllers" {print $1}' "$STATE_DIR/tokens.csv" >"$STATE_DIR/dns/token")
  start dns "$bin" -listen "127.0.0.1:$DNS_PORT" -server "$API" -ca "$PKI/ca.crt" \
    -token-file "$STATE_DIR/dns/token" -zone cluster.local
  wait_for dns 30 "the DNS on udp 127.0.0.1:$DNS_PORT" dns_listening
}

ctr2() { ctr --address "$CTRD2_SOCK" --namespace k8s.io "$@"; }

# The second node has the images of the first (imported there, never pulled): streamed from
# buildah's storage when images.sh built them (their key is the label mflow.dev/e2e-key), else
# exported from the first node's containerd.
copy_images() {
  local ref key rest=() t=$SECONDS
  while read -r ref key; do
    if [ -n "$key" ] && is_built "$ref" "$key"; then
      import_built "$CTRD2_SOCK" "$ref" "$key" 2>>"$LOGS/containerd2-images.log" ||
        fail containerd2-images "importing $ref into the second node's containerd failed"
    else
      rest+=("$ref")
    fi
  done < <(ctr_ images ls | awk 'NR > 1 && $1 !~ /^sha256:/ {
    k = ""; if (match($0, /mflow\.dev\/e2e-key=[0-9a-f]+/)) k = substr($0, RSTART + 18, RLENGTH - 18); print $1, k }')
  if [ ${#rest[@]} -gt 0 ]; then
    ctr_ images export "$CTRD2/images.tar" "${rest[@]}" >>"$LOGS/containerd2-images.log" 2>&1 ||
      fail containerd2-images "exporting ${rest[*]} from the first node failed"
    ctr2 images import "$CTRD2/images.tar" >>"$LOGS/containerd2-images.log" 2>&1 ||
      fail containerd2-images "importing ${rest[*]} into the second node's containerd failed"
    rm -f "$CTRD2/images.tar"
  fi
  log "images of the first node copied to the second in $((SECONDS - t))s"
}

node2_kubeconfig() {
  # A client certificate of system:node:NODE2 in group system:nodes, for the Node authorizer.
  sign kubelet2 "/O=system:nodes/CN=system:node:$NODE2" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  cat >"$KCFG/kubelet2.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: mflow-e2e
  cluster:
    server: $API
    certificate-authority: $PKI/ca.crt
users:
- name: system:node:$NODE2
  user:
    client-certificate: $PKI/kubelet2.crt
    client-key: $PKI/kubelet2.key
contexts:
- name: mflow-e2e
  context:
    cluster: mflow-e2e
    user: system:node:$NODE2
current-context: mflow-e2e
EOF
  chmod 600 "$KCFG/kubelet2.kubeconfig"
}

start_node2() {
  if alive kubelet2; then
    log "kubelet2 is running"
    return 0
  fi
  local t=$SECONDS
  check_ports "$KUBELET2_PORT" "$KUBELET2_HEALTHZ_PORT" "$CRI2_STREAM_PORT"
  start_containerd containerd2 "$CTRD2" "$CRI2_STREAM_PORT"
  wait_for containerd2 30 "the second containerd's socket" ctr2 version
  copy_images
  node2_kubeconfig
  start_kubelet kubelet2 "$NODE2" "$KUBELET2_PORT" "$KUBELET2_HEALTHZ_PORT" "$CTRD2_SOCK" "$STATE_DIR/kubelet2-pod-logs"
  wait_for kubelet2 90 "node $NODE2 Ready" node_ready "$NODE2"
  log "node $NODE2 Ready in $((SECONDS - t))s"
}

# stop_node2: the kubelet, then its Node (else the scheduler would still place pods on it),
# its containers and containerd, and what they mounted.
stop_node2() {
  stop_components kubelet2
  k delete node "$NODE2" --ignore-not-found --wait=false >/dev/null 2>&1 || true
  stop_containers containerd2 "$CTRD2_SOCK"
  stop_components containerd2
  unmount_state "$CTRD2/"
  unmount_state "$STATE_DIR/kubelet2/"
  local l
  for l in /var/log/containers/*.log; do
    [ -L "$l" ] && case $(readlink "$l") in "$STATE_DIR/kubelet2-pod-logs"/*) rm -f "$l" ;; esac
  done
  rm -rf "$CTRD2" "$STATE_DIR/kubelet2" "$STATE_DIR/kubelet2-pod-logs"
}
