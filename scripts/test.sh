#!/usr/bin/env bash
# The tests: installs what is missing, builds (with CUDA where nvcc is found, so kernel code
# always compiles), runs the unit tests, then rebuilds CPU-only under AddressSanitizer +
# UndefinedBehaviorSanitizer and runs them again. GPU tests (label gpu) skip without a GPU;
# run them on a GPU machine with: ctest --test-dir build -L gpu --output-on-failure
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/deps.sh
bash scripts/build.sh
ctest --test-dir build -L unit --output-on-failure -j "$(nproc)"
BUILD_DIR=build-asan bash scripts/build.sh -DTANDEM_SANITIZE=ON -DTANDEM_CUDA=OFF
ASAN_OPTIONS=detect_leaks=1 ctest --test-dir build-asan -L unit --output-on-failure -j "$(nproc)"
