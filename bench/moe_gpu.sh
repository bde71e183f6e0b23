#!/usr/bin/env bash
# bench/moe_gpu.sh — the GPU half of the MoE and split-target work in one GPU-machine call: the CUDA MoE kernels
# against their cpu reference (test_kn_moe cuda), the CUDA dump of every oracle fixture, MoE and Qwen3-Next
# included, with its routing (test_ts_dump cuda bf16 and fp32), a target split over stages on the GPUs
# (test_ts_split cuda: two stages on GPU 0, and on GPUs 0 and 1 when there are two), then the target benchmark at
# the Qwen3.5-35B-A3B shape beside Transformers + FLA (bench/target_bench.sh with that config: tokens/s, the
# routed experts' GEMM time and share, bf16 and fp8).
#   usage: bench/moe_gpu.sh BUILD_DIR OUT_DIR
# The tests' logs go to OUT_DIR/<test>.log and the benchmark's files to OUT_DIR/moe35/; a line per test and the
# benchmark's tables are printed. Environment: as bench/target_bench.sh (ITERS, SKIP_HF, HF_TIMEOUT ...).
set -uo pipefail
build=${1:?usage: moe_gpu.sh BUILD_DIR OUT_DIR}
out=${2:?usage: moe_gpu.sh BUILD_DIR OUT_DIR}
mkdir -p "$out"
t0=$SECONDS
run() { # run NAME LIMIT_S COMMAND...: its log, and one line with its exit status and the check counts
    local name=$1 limit=$2
    shift 2
    (cd "$build/tests" && timeout "$limit" "$@") >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc, $(grep -E 'checks, ' "$out/$name.log" | tail -1) [$((SECONDS - t0)) s]"
}
run kn_moe_cuda 300 ./test_kn_moe cuda
run ts_dump_cuda_bf16 300 ./test_ts_dump cuda bf16
run ts_dump_cuda_fp32 300 ./test_ts_dump cuda fp32
grep -hE "moe|next|routing" "$out"/ts_dump_cuda_*.log
run ts_split_cuda 300 ./test_ts_split cuda
grep -E "bit-identical|in flight" "$out/ts_split_cuda.log" | tail -4
CONFIG=deploy/configs/qwen3.5-35b-a3b/target-config.json ITERS=${ITERS:-3} \
    bash bench/target_bench.sh "$build" "$out/moe35" >"$out/moe35.log" 2>&1
echo "target_bench (35B-A3B): exit $? [$((SECONDS - t0)) s]"
tail -n 80 "$out/moe35.log"
