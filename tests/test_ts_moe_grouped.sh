#!/usr/bin/env bash
# tests/test_ts_moe_grouped.sh — the routed experts' GEMMs grouped in one moe_gemm call give what
# one GEMM per expert gives: the MoE oracle fixture whose widths moe_gemm takes (qwen35moe_mm_fused:
# hidden 24, expert width 16; the others' expert width 12 is not a multiple of 8) dumped on the cpu
# through the fused bf16 path (TANDEM_TARGET_FUSED=1 --precision bf16) and again with
# TANDEM_MOE_GEMM=loop: the log must say which ran, and the two files must be equal byte for byte
# (the cpu reference sums both in double). The same at --precision fp8 (the bf16 experts quantized
# on load: moe_gemm_fp8 against one gemm_fp8 per expert), on qwen35moe_mm_fused and on
# qwen35moe_flat_experts (any width: the cpu's FP8 product takes any shape). Also: a bad
# TANDEM_MOE_GEMM is named in a warning.
# Usage: test_ts_moe_grouped.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
bin=$build/target-server/target-server
tmp=$(mktemp -d /tmp/tandem-moe-grouped-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fails=0
fix=qwen35moe_mm_fused
f=$src/tests/fixtures/target/$fix
for mode in grouped loop; do
    TANDEM_TARGET_FUSED=1 TANDEM_MOE_GEMM=$mode "$bin" dump --model "$f/model" --input "$f/input.safetensors" \
        --out "$tmp/$mode.st" --device cpu --precision bf16 --logits 2>"$tmp/$mode.log"
done
if grep -q "routed experts: grouped" "$tmp/grouped.log" &&
    grep -q "routed experts: one GEMM per expert (TANDEM_MOE_GEMM=loop)" "$tmp/loop.log"; then
    echo "ok: the log names the path that ran"
else
    echo "FAIL: the log does not say grouped / per expert:"; grep routed "$tmp"/*.log; fails=$((fails + 1))
fi
if cmp -s "$tmp/grouped.st" "$tmp/loop.st"; then
    echo "ok: $fix grouped = per expert, every layer, final norm, logits and routing"
else
    echo "FAIL: $fix grouped differs from per expert"; fails=$((fails + 1))
fi
for fix in qwen35moe_mm_fused qwen35moe_flat_experts; do
    f=$src/tests/fixtures/target/$fix
    for mode in grouped loop; do
        TANDEM_TARGET_FUSED=1 TANDEM_MOE_GEMM=$mode "$bin" dump --model "$f/model" --input "$f/input.safetensors" \
            --out "$tmp/$mode-fp8.st" --device cpu --precision fp8 --logits 2>"$tmp/$mode-fp8.log"
    done
    if grep -q "routed experts: grouped, every expert's GEMMs in one moe_gemm_fp8 call" "$tmp/grouped-fp8.log" &&
        grep -q "routed experts: one GEMM per expert (TANDEM_MOE_GEMM=loop)" "$tmp/loop-fp8.log"; then
        echo "ok: $fix fp8: the log names the path that ran"
    else
        echo "FAIL: $fix fp8: the log does not say grouped / per expert:"; grep routed "$tmp"/*-fp8.log
        fails=$((fails + 1))
    fi
    if cmp -s "$tmp/grouped-fp8.st" "$tmp/loop-fp8.st"; then
        echo "ok: $fix fp8 grouped = per expert, every layer, final norm, logits and routing"
    else
        echo "FAIL: $fix fp8 grouped differs from per expert"; fails=$((fails + 1))
    fi
done
f=$src/tests/fixtures/target/qwen3next_flat
TANDEM_MOE_GEMM=fast "$bin" dump --model "$f/model" --input "$f/input.safetensors" --out "$tmp/w.st" \
    --device cpu --log-level warn 2>"$tmp/err"
if grep -q "TANDEM_MOE_GEMM='fast' is neither 'grouped' nor 'loop'" "$tmp/err"; then
    echo "ok: a bad TANDEM_MOE_GEMM is named"
else
    echo "FAIL: no warning for TANDEM_MOE_GEMM=fast:"; cat "$tmp/err"; fails=$((fails + 1))
fi
[[ $fails -eq 0 ]]
