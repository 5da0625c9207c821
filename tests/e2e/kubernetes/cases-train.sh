# shellcheck shell=bash
# Cases of run.sh (the main job as TrainJobs on the real kubelet: training, evaluation and export from the images of docker/Dockerfile).
# Sourced by cases.sh; each case_NAME follows its conventions.

KWOK_CASES+=()
KUBELET_CASES+=()
