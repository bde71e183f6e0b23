#!/usr/bin/env bash
# On a GPU machine, from a finished build: the GPU tests (label gpu, every CUDA kernel against
# its CPU reference and the CUDA dump against the Transformers oracle), then the unit tests,
# then the CUDA dump of the embedded model, and with ORACLE_PYTHON the MoE fixtures' bf16 dumps
# against the forced-routing oracle. Logs go to LOG_DIR (default /tmp/tandem-gpu).
#   usage: scripts/gpu-check.sh [BUILD_DIR]
set -uo pipefail
cd "$(dirname "$0")/.." || exit
build=${1:-build}
logs=${LOG_DIR:-/tmp/tandem-gpu}
mkdir -p "$logs"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$logs/gpu.txt"
rc=0
ctest --test-dir "$build" -L gpu --output-on-failure -V 2>&1 | tee "$logs/gpu-tests.log" || rc=1
ctest --test-dir "$build" -L unit --output-on-failure 2>&1 | tee "$logs/unit-tests.log" || rc=1
for p in bf16 fp32; do
    "$build/target-server/target-server" dump --model models/tiny-qwen35 --device cuda --precision $p \
        --input models/tiny-qwen35/example_input.safetensors --out "$logs/tiny-$p.safetensors" --logits \
        2>&1 | tee -a "$logs/dump.log" || rc=1
done
# The MoE fixtures' bf16 dumps against the float64 oracle forced to their routing (tests/oracle/forced_routing.py),
# where ORACLE_PYTHON names a python with the oracle's torch and transformers (tests/oracle/README.md).
if [ -n "${ORACLE_PYTHON:-}" ]; then
    for f in qwen35moe_mm_fused qwen35moe_flat_experts qwen3next_flat; do
        F=tests/fixtures/target/$f
        "$build/target-server/target-server" dump --model $F/model --input $F/input.safetensors --device cuda \
            --precision bf16 --logits --out "$logs/$f-bf16.safetensors" --log-level warn || rc=1
        "$ORACLE_PYTHON" tests/oracle/forced_routing.py $f "$logs/$f-bf16.safetensors" 2>&1 |
            tee -a "$logs/forced-routing.log" || rc=1
    done
fi
exit $rc
