# shellcheck shell=bash
# Cases of run.sh (following a stage on a real cluster: disruptions, broken log streams, node and suspend states, and many nodes).
# Sourced by cases.sh; each case_NAME follows its conventions.

KWOK_CASES+=()
KUBELET_CASES+=()
