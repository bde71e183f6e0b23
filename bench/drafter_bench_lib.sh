# bench/drafter_bench_lib.sh — helpers shared by the drafter benchmarks (bench/drafter_bench.sh, DFlash;
# bench/drafter2_bench.sh, DFlash2; bench/speed_bench.sh and bench/pipeline_2gpu.sh); sourced, not run. The
# caller sets $out (the output folder) and $gpu (the device index) for sampled and gpu_info.

# a training dataset of 64 documents of 2048 random token ids (seed 1) into the JSONL file $1
random_docs() {
    python3 -c "
import json, random, sys
random.seed(1)
with open(sys.argv[1], 'w') as f:
    for i in range(64):
        f.write(json.dumps({'input_ids': [random.randrange(1000, 240000) for _ in range(2048)]}) + '\\n')" "$1"
}

# sample GPU memory while "$@" runs; the peak MiB goes to $out/$name.smi
sampled() {
    local name=$1; shift
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i "$gpu" -lms 100 >"$out/$name.smi.log" 2>/dev/null &
    local smi=$!
    "$@"
    local rc=$?
    kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
    sort -n "$out/$name.smi.log" | tail -1 >"$out/$name.smi"
    return $rc
}

# the GPU's name, max SM clock, memory and driver into $out/gpu.txt
gpu_info() {
    nvidia-smi --query-gpu=name,clocks.max.sm,memory.total,driver_version --format=csv,noheader -i "$gpu" >"$out/gpu.txt" 2>&1
}
