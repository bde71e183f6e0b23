#!/usr/bin/env bash
# Configures and builds Tandem into BUILD_DIR (default build/): with CUDA where nvcc is found
# (architectures from CUDA_ARCHS, default 90), CPU-only elsewhere. Extra args go to cmake.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
cmake -S . -B "$build" -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}" "$@" >/dev/null
cmake --build "$build" -j "$(nproc)"
