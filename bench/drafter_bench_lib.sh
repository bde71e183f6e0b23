# bench/drafter_bench_lib.sh — helpers shared by bench/drafter_bench.sh (DFlash) and bench/drafter2_bench.sh
# (DFlash2); sourced, not run. The caller sets $out (the output folder) and $gpu (the device index).

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
