# shellcheck shell=bash
# Sourced by every GPU script, from the repository root: NVLink multicast off, the output folder,
# and the wheels of .whl/ (megatron-core, blake3) installed into /tmp/site and put on PYTHONPATH
# together with the workloads.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mflow-gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/workloads
