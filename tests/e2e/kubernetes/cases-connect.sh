# shellcheck shell=bash
# Cases of run.sh (reaching the cluster: rejected credentials, missing namespaces, untrusted certificates, kubeconfig mistakes).
# Sourced by cases.sh; each case_NAME follows its conventions.

KWOK_CASES+=(rejected_credentials missing_namespace)
KUBELET_CASES+=()

CONNECT_STAGE='[stages.one]
kind = "command"
run = ["sh", "-c", "true"]'

# The words of a refusal for rejected credentials of USER, without TOKEN anywhere, and without
# the advice about rights that a rejected credential cannot use.
said_rejected() {
  local token=$1 user=$2 out
  out=$(last | tr -s ' │\n' ' ')
  contains "$out" "rejected the credentials of context \"mflow-e2e\" (user \"$user\")"
  contains "$out" "HTTP 401"
  contains "$out" "kubectl create token"
  not_contains "$out" "$token"
  not_contains "$out" "forbidden"
  not_contains "$out" "mflow kube rbac"
}

# Every command that reaches the cluster says the same, with exit 2: `mflow run` (its
# preflight), `run --dry-run`, and `runs` and `status` as for runs started outside the cluster.
rejected_everywhere() {
  local kubeconfig=$1 token=$2 user=$3 spec=$4
  KUBECONFIG="$kubeconfig" expect 2 mf run "$spec"
  said_rejected "$token" "$user"
  KUBECONFIG="$kubeconfig" expect 2 mf run --dry-run "$spec"
  said_rejected "$token" "$user"
  KUBECONFIG="$kubeconfig" expect 2 mf runs --backend kubernetes
  said_rejected "$token" "$user"
  KUBECONFIG="$kubeconfig" expect 2 mf status --backend kubernetes
  said_rejected "$token" "$user"
  # Nor at the most verbose log level.
  KUBECONFIG="$kubeconfig" expect 2 env RUST_LOG=trace "$MFLOW_BIN" run "$spec"
  not_contains "$(last)" "$token"
}

# A garbage token and the token of a ServiceAccount deleted since (HTTP 401 from the API
# server) are said to be rejected credentials of the context and user, never shown, and never
# taken for missing rights; a server certificate signed by another CA is said to be untrusted.
case_rejected_credentials() {
  local spec garbage="$STATE_DIR/garbage.kubeconfig" sa="$STATE_DIR/deleted-sa.kubeconfig" token
  spec=$(write_spec rejected_credentials <<<"$CONNECT_STAGE")

  token="e2egarbage$(openssl rand -hex 16)"
  sed "s/^\(    token:\).*/\1 $token/" "$STATE_DIR/kubeconfig/admin.kubeconfig" >"$garbage"
  rejected_everywhere "$garbage" "$token" admin "$spec"

  kc create serviceaccount e2e-doomed
  bash "$E2E_DIR/cluster.sh" sa-kubeconfig "$NS" e2e-doomed "$sa"
  token=$(sed -n 's/^    token: //p' "$sa")
  [ -n "$token" ] || { echo "no token in $sa"; return 1; }
  kubectl --kubeconfig "$sa" get --raw /version >/dev/null
  kc delete serviceaccount e2e-doomed
  wait_until 30 bash -c "! kubectl --kubeconfig '$sa' get --raw /version"
  rejected_everywhere "$sa" "$token" system:serviceaccount:ml:e2e-doomed "$spec"
  eq "$(trainjobs rejected_credentials)" 0

  # The admin's own token with a CA that did not sign the server's certificate.
  local other="$STATE_DIR/other-ca" wrong_ca="$STATE_DIR/wrong-ca.kubeconfig" out
  mkdir -p "$other"
  openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=not-this-clusters-ca -keyout "$other/ca.key" -out "$other/ca.crt" 2>/dev/null
  sed "s|^\(    certificate-authority:\).*|\1 $other/ca.crt|" "$STATE_DIR/kubeconfig/admin.kubeconfig" >"$wrong_ca"
  token=$(sed -n 's/^    token: //p' "$wrong_ca")
  for args in "run $spec" "runs --backend kubernetes"; do
    # shellcheck disable=SC2086
    KUBECONFIG="$wrong_ca" expect 2 mf $args
    out=$(last | tr -s ' │\n' ' ')
    contains "$out" "the certificate of the Kubernetes API server at https://127.0.0.1:6443/ is not trusted (context \"mflow-e2e\" (user \"admin\"))"
    contains "$out" "certificate-authority"
    not_contains "$out" "check that the cluster is running"
    not_contains "$out" "$token"
  done
}

# A namespace that does not exist is said to be missing (not a missing claim), with how to
# create it, by `run`, `run --dry-run` and the commands that read runs; one whose name is over
# Kubernetes' limit is refused before any request, naming the limit.
case_missing_namespace() {
  local spec out long
  spec=$(write_spec missing_namespace 'namespace = "e2e-nowhere"' <<<"$CONNECT_STAGE")
  expect 2 mf run "$spec"
  out=$(last | tr -s ' │\n' ' ')
  contains "$out" "namespace \"e2e-nowhere\" does not exist"
  contains "$out" "kubectl create namespace e2e-nowhere"
  not_contains "$out" "PersistentVolumeClaim"
  [ ! -d "$(case_dir missing_namespace)/wd/runs" ] || { echo "a run started"; return 1; }
  expect 2 mf run --dry-run "$spec"
  contains "$(last | tr -s ' │\n' ' ')" "namespace \"e2e-nowhere\" does not exist"
  for cmd in runs status; do
    expect 2 mf "$cmd" --backend kubernetes --namespace e2e-nowhere
    out=$(last | tr -s ' │\n' ' ')
    contains "$out" "namespace \"e2e-nowhere\" does not exist"
    not_contains "$out" "no runs started outside the cluster"
  done
  expect 2 mf cancel 20260101-000000-000-aaaa --namespace e2e-nowhere
  contains "$(last | tr -s ' │\n' ' ')" "namespace \"e2e-nowhere\" does not exist"

  long="team$(printf 'a%.0s' $(seq 1 66))"
  spec=$(write_spec missing_namespace "namespace = \"$long\"" <<<"$CONNECT_STAGE")
  expect 2 mf run "$spec"
  contains "$(last | tr -s ' │\n' ' ')" "namespace \"$long\" is 70 characters long; Kubernetes allows at most 63"
  expect 2 mf runs --backend kubernetes --namespace "$long"
  contains "$(last | tr -s ' │\n' ' ')" "is 70 characters long; Kubernetes allows at most 63"
}
