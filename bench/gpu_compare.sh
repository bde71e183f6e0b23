#!/usr/bin/env bash
# bench/gpu_compare.sh — on a GPU machine, in one run: the GPU tests of a build (every ctest
# test labelled gpu, run from the commands ctest lists, each with its timeout; exit 77 = skip),
# then the target forward (bench_ts_target) and the drafter step (bench_dt_step) at the
# Qwen3.6-27B shape, this build's and a reference build's, one after the other on the same GPU,
# so that a change that must not move the figures is measured beside what it changed.
#   usage: bench/gpu_compare.sh BUILD_DIR REF_BUILD_DIR OUT_DIR
# BUILD_DIR holds tests/, target-server/ and drafter-trainer/ as built (at the path the tests
# were configured with: they find the programs through it); REF_BUILD_DIR needs only
# tests/bench_ts_target and tests/bench_dt_step (empty: no reference). GPU_TESTS is a file of
# lines "NAME TIMEOUT_S COMMAND..." (default: BUILD_DIR/gpu-tests.txt, written by
# `bench/gpu_compare.sh --list BUILD_DIR` where ctest runs). ROUNDS (default 2) alternates
# ours and the reference that many times.
set -uo pipefail
if [[ ${1:-} == --list ]]; then
    ctest --test-dir "$2" -L gpu --show-only=json-v1 | python3 -c '
import json, shlex, sys
for t in json.load(sys.stdin)["tests"]:
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    print(t["name"], int(float(props.get("TIMEOUT", 300))), shlex.join(t["command"]))'
    exit 0
fi
build=${1:?usage: gpu_compare.sh BUILD_DIR REF_BUILD_DIR OUT_DIR}
ref=${2?usage: gpu_compare.sh BUILD_DIR REF_BUILD_DIR OUT_DIR}
out=${3:?usage: gpu_compare.sh BUILD_DIR REF_BUILD_DIR OUT_DIR}
list=${GPU_TESTS:-$build/gpu-tests.txt}
cfgdir=deploy/configs/qwen3.6-27b
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"

pass=0 fail=0 skip=0
while read -r name limit cmd; do
    [[ -z $name ]] && continue
    t0=$SECONDS
    (cd "$build/tests" && eval "timeout $limit $cmd") >"$out/$name.log" 2>&1
    rc=$?
    case $rc in
    0) pass=$((pass + 1)) r=passed ;;
    77) skip=$((skip + 1)) r=skipped ;;
    *) fail=$((fail + 1)) r="FAILED (exit $rc)" ;;
    esac
    echo "$name: $r in $((SECONDS - t0)) s" | tee -a "$out/gpu-tests.txt"
done <"$list"
echo "gpu tests: $pass passed, $fail failed, $skip skipped" | tee -a "$out/gpu-tests.txt"

bench() { # bench NAME DIR
    local name=$1 dir=$2
    "$dir/tests/bench_ts_target" --config "$cfgdir/target-config.json" --tokens 8192 --iters 5 \
        --json "$out/target-$name.json" >"$out/target-$name.md" 2>"$out/target-$name.err"
    echo "target $name: exit $? $(grep -m1 -i 'tokens/s' "$out/target-$name.md")"
    "$dir/tests/bench_dt_step" --drafter-config "$cfgdir/drafter.json" --target-config "$cfgdir/target-config.json" \
        --precision bf16 --steps 5 --warmup 2 >"$out/step-$name.json" 2>"$out/step-$name.err"
    echo "step $name: exit $? $(tail -c 400 "$out/step-$name.json" | tr '\n' ' ')"
}
for r in $(seq "${ROUNDS:-2}"); do
    bench "ours-$r" "$build"
    [[ -n $ref ]] && bench "ref-$r" "$ref"
done
exit $((fail > 0))
