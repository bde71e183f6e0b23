#!/usr/bin/env bash
# The tests: installs what is missing, builds (with CUDA where nvcc is found, so kernel code
# always compiles), runs the unit tests and the z-lab interoperability test, then rebuilds
# CPU-only under AddressSanitizer + UndefinedBehaviorSanitizer and runs the unit tests again.
# GPU tests (label gpu) skip without a GPU; run them on a GPU machine with:
#   ctest --test-dir build -L gpu --output-on-failure
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/deps.sh
bash scripts/build.sh
ctest --test-dir build -L unit --output-on-failure -j "$(nproc)"
# Interoperability with z-lab's dflash package (tests/interop/run_zlab.sh): trains the tiny DFlash drafter,
# loads it in z-lab's DFlashDraftModel and decodes the held-out prompts with z-lab's decoder against the target
# in Transformers (lossless, real τ against Tandem's estimate). Needs PyPI for its virtual environment (made
# once in build/interop-venv); TANDEM_INTEROP=0 skips it.
if [ "${TANDEM_INTEROP:-1}" != 0 ]; then BUILD_DIR=build bash tests/interop/run_zlab.sh; fi
BUILD_DIR=build-asan bash scripts/build.sh -DTANDEM_SANITIZE=ON -DTANDEM_CUDA=OFF
ASAN_OPTIONS=detect_leaks=1 ctest --test-dir build-asan -L unit --output-on-failure -j "$(nproc)"
# Fuzz targets (tests/fuzz): rebuilt with clang + libFuzzer; each parser is fuzzed 15 s from its
# seeds and its crash inputs replayed (about 2 minutes on 2 cores).
cmake -S . -B build-fuzz -DTANDEM_FUZZ=ON -DTANDEM_CUDA=OFF -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ >/dev/null
cmake --build build-fuzz --target fuzz_all -j "$(nproc)"
ctest --test-dir build-fuzz -L fuzz --output-on-failure -j "$(nproc)"
