#!/usr/bin/env bash
# Run on a machine with an NVIDIA GPU: builds with CUDA, runs the GPU tests
# (and, as they land, the GPU benchmark cases). Must finish in < 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L || { echo "no GPU visible"; exit 1; }
make -j"$(nproc)" CUDA=1 BUILD=build-gpu lib gpu-tests
status=0
for t in build-gpu/gpu/test_gpu_*; do
    echo "== $t"; "$t" || status=1
done
exit $status
