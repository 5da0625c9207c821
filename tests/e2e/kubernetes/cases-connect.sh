# shellcheck shell=bash
# Cases of run.sh (reaching the cluster: rejected credentials, missing namespaces, untrusted certificates, kubeconfig mistakes).
# Sourced by cases.sh; each case_NAME follows its conventions.

KWOK_CASES+=()
KUBELET_CASES+=()
