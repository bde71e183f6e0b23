#!/usr/bin/env bash
# bench/speed_bench.sh — every figure of the speed goals (issue 21) in one GPU-machine call, at the
# Qwen3.6-27B shape of deploy/configs/qwen3.6-27b (random weights), each beside its reference measured in
# the same call:
#   target:   the bf16 forward on 8192-token packs (bench_ts_target): tokens/s, the GEMM-only bound at the
#             cuBLASLt ceiling measured in the same run, the GDN core in the forward and the GDN and attention
#             kernels alone; then the fp8 forward (--precision fp8: random bf16 weights quantized on load)
#             against its FP8 GEMM-only bound and the bf16 forward (issue 19's figures); with REF_BUILD_DIR
#             the same from that build (the "before");
#   drafter:  the DFlash drafter step (bench_dt_step, bf16) and bench/drafter_flex.py on the same batch layout,
#             peak memory (each program's own figure and nvidia-smi's), a --profile run, and the step against
#             its GEMMs' time at the ceiling the target part measured;
#   pipeline: tandem-launch --gpus over every GPU of the machine (its own split; one GPU is shared by a server
#             and a trainer), FP8 target, STEPS trainer steps: tokens trained per second, per GPU, waiting,
#             and the launcher's supply-and-demand report.
# Then bench/speed_report.py writes OUT_DIR/speed.md (copy it to bench/results/speed-<date>.md).
#   usage: bench/speed_bench.sh BUILD_DIR OUT_DIR [REF_BUILD_DIR]
#   env: PARTS (default "target drafter pipeline"), STEPS (pipeline trainer steps, default 20), WORK (the
#        pipeline's dataset and run directory, default /dev/shm/tandem-speed: its final 27 GB checkpoint is
#        written in seconds there), PIPELINE_TIMEOUT (seconds, default 420)
# About 3 minutes for the target, 3 for the drafter and 4–5 for the pipeline on one H200: all three fit a
# 10-minute call only just; PARTS splits them over two.
set -uo pipefail
build=${1:?usage: speed_bench.sh BUILD_DIR OUT_DIR [REF_BUILD_DIR]}
out=${2:?usage: speed_bench.sh BUILD_DIR OUT_DIR [REF_BUILD_DIR]}
ref=${3:-}
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
cfgdir=$root/deploy/configs/qwen3.6-27b
parts=" ${PARTS:-target drafter pipeline} "
gpu=0
mkdir -p "$out"
# shellcheck source=bench/drafter_bench_lib.sh
source "$here/drafter_bench_lib.sh" # sampled, gpu_info, random_docs
gpu_info
has() { [[ $parts == *" $1 "* ]]; }

if has target; then
    for b in "$build" ${ref:+"$ref"}; do
        for prec in bf16 fp8; do
            name=target
            [[ $b == "$build" ]] || name=target-ref
            [[ $prec == bf16 ]] || name+=-fp8
            echo "== $name ($b)" >&2
            "$b/tests/bench_ts_target" --config "$cfgdir/target-config.json" --tokens 8192 --iters 5 \
                --gpu "$gpu" --precision "$prec" --json "$out/$name.json" >"$out/$name.md" 2>"$out/$name.err" ||
                echo "$name failed: $(tail -3 "$out/$name.err")" >&2
        done
    done
fi

if has drafter; then
    args=(--drafter-config "$cfgdir/drafter.json" --target-config "$cfgdir/target-config.json" --precision bf16
        --gpu "$gpu")
    echo "== drafter step" >&2
    sampled step "$build/tests/bench_dt_step" "${args[@]}" --steps 5 --warmup 2 --layout "$out/layout.safetensors" \
        >"$out/step.json" 2>"$out/step.err" || echo "drafter step failed: $(tail -3 "$out/step.err")" >&2
    echo "== drafter_flex.py" >&2
    sampled flex env CUDA_VISIBLE_DEVICES="$gpu" PYTHONUNBUFFERED=1 python3 "$here/drafter_flex.py" \
        --drafter-config "$cfgdir/drafter.json" --layout "$out/layout.safetensors" --steps 5 --warmup 2 \
        >"$out/flex.log" 2>"$out/flex.err" || echo "drafter_flex.py failed: $(tail -3 "$out/flex.err")" >&2
    grep '^{' "$out/flex.log" | tail -1 >"$out/flex.json"
    echo "== drafter step --profile" >&2
    "$build/tests/bench_dt_step" "${args[@]}" --steps 2 --warmup 1 --profile >"$out/profile.txt" \
        2>"$out/profile.err" || echo "profile failed: $(tail -3 "$out/profile.err")" >&2
fi

if has pipeline; then
    n=$(nvidia-smi -L | wc -l)
    gpus=$(seq -s, 0 $((n - 1)))
    work=${WORK:-/dev/shm/tandem-speed}
    rm -rf "$work" "$out/pipeline"
    mkdir -p "$work" "$out/pipeline"
    echo "$gpus" >"$out/pipeline/gpus.txt"
    random_docs "$work/d.jsonl"
    mkdir -p "$work/model" # tandem-launch takes a model directory; random weights need only its config.json
    cp "$cfgdir/target-config.json" "$work/model/config.json"
    echo "== pipeline: tandem-launch --gpus $gpus" >&2
    timeout "${PIPELINE_TIMEOUT:-420}" "$root/deploy/tandem-launch" --gpus "$gpus" --bin-dir "$build" \
        --model "$work/model" --drafter-config "$cfgdir/drafter.json" \
        --server-args "--init random --seed 1 --precision fp8" --balance-after "$((${STEPS:-20} / 2))" \
        --out "$work/run" -- --target-init random --target-seed 1 --dataset "$work/d.jsonl" --token-budget 8192 \
        --steps "${STEPS:-20}" --max-anchors 512 --precision bf16 --progress lines --log-every 1 \
        --no-tensorboard >"$out/pipeline/launch.log" 2>&1 || echo "pipeline failed: $(tail -3 "$out/pipeline/launch.log")" >&2
    for m in "$work"/run/metrics.jsonl "$work"/run/rank-*/metrics.jsonl; do
        [[ -f $m ]] || continue
        r=$(basename "$(dirname "$m")")
        [[ $r == run ]] && r=rank-0
        cp "$m" "$out/pipeline/metrics-$r.jsonl"
    done
    cp "$work/run/logs/balance.txt" "$out/pipeline/balance.txt" 2>/dev/null
    rm -rf "$work"
fi

python3 "$here/speed_report.py" "$out"
