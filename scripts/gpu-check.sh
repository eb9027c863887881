#!/usr/bin/env bash
# Run on a machine with an NVIDIA GPU (budget: under 8 minutes on one GPU).
#  1. the whole suite built with CUDA: the arena's pinned/device paths run for real;
#  2. the GPU tests (tests/gpu): device view copies checked element by element
#     over the whole destination pool, plus the GPU benchmark line (JSON,
#     candidate vs a device-to-device cudaMemcpy of the same bytes).
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L || { echo "no GPU visible"; exit 1; }
# deps.sh also wants clang and the RDMA headers; a GPU box without them (and
# without a package mirror) can still build and run the GPU checks.
scripts/deps.sh || echo "gpu-check: some optional packages are missing; continuing"
make -j"$(nproc)" CUDA=1 BUILD=build-gpu lib gpu-tests
make CUDA=1 BUILD=build-gpu test
status=0
for t in build-gpu/gpu/test_gpu_*; do
    case "$t" in *.d) continue ;; esac
    echo "== $t"; "$t" || status=1
done
exit $status
