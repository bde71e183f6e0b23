#!/usr/bin/env bash
# bench/fp8_accum_model.sh — how far the W8A8 forward moves when each 128-wide group is summed with less than
# fp32's width, as an FP8 tensor core sums it. `target-server dump --precision fp8` on the CPU, exact (the
# specification) and again with the reference's accumulation model (TANDEM_FP8_REF_TC=BITS[:CHUNK[:PROMOTE]],
# kernels/ref/kn_fp8_tc_ref.c), on the embedded trained target models/tandem-tiny and on the FP8 fixtures; each
# cell is the worst relative L2 over the dump's tensors (every layer, the final norm, the logits) against the exact
# dump, the measure `test_ts_dump cuda fp8` holds to its tolerance. With --cuda, also the CUDA fp8 dump (the rest
# in fp32, TANDEM_FP8_REST=fp32 as the test runs it) against the exact one and against each model.
#   usage: bench/fp8_accum_model.sh BUILD_DIR OUT_DIR [--cuda]
set -euo pipefail
build=${1:?usage: fp8_accum_model.sh BUILD_DIR OUT_DIR [--cuda]}
out=${2:?usage: fp8_accum_model.sh BUILD_DIR OUT_DIR [--cuda]}
cuda=${3:-}
ts=$build/target-server/target-server
mkdir -p "$out"
models="13 14 15 18 22 26 14:32:1 14:8:1"
cases=("tandem-tiny models/tandem-tiny models/tiny-qwen35/example_input.safetensors")
for f in tests/fixtures/target_fp8/*/; do
    f=${f%/}
    cases+=("$(basename "$f") $f/model $f/input.safetensors")
done
dump() { # model input out [env...]
    local m=$1 i=$2 o=$3
    shift 3
    env "$@" "$ts" dump --model "$m" --input "$i" --out "$o" --device "${DEV:-cpu}" --precision fp8 --logits \
        --log-level error
}
{
    printf '| case | %s |' "$(echo $models | sed 's/ / | /g')"
    [ -n "$cuda" ] && printf ' cuda vs exact | cuda vs 13 | cuda vs 14 | cuda vs 15 |'
    echo
    printf '| --- |'
    for _ in $models; do printf ' ---: |'; done
    [ -n "$cuda" ] && printf ' ---: | ---: | ---: | ---: |'
    echo
    for c in "${cases[@]}"; do
        set -- $c
        name=$1 model=$2 input=$3
        dump "$model" "$input" "$out/$name-exact.st"
        row="| $name |"
        for tc in $models; do
            dump "$model" "$input" "$out/$name-$tc.st" TANDEM_FP8_REF_TC="$tc"
            row="$row $(python3 bench/st_diff.py "$out/$name-exact.st" "$out/$name-$tc.st") |"
        done
        if [ -n "$cuda" ]; then
            if DEV=cuda dump "$model" "$input" "$out/$name-cuda.st" TANDEM_FP8_REST=fp32 2>"$out/$name-cuda.err"; then
                for ref in exact 13 14 15; do
                    row="$row $(python3 bench/st_diff.py "$out/$name-$ref.st" "$out/$name-cuda.st") |"
                done
            else # refused (an input width the FP8 kernels cannot take): the message goes to stderr
                cat "$out/$name-cuda.err" >&2
                row="$row refused | | | |"
            fi
        fi
        echo "$row"
        rm -f "$out/$name"-*.st
    done
} | tee "$out/fp8_accum_model.md"
