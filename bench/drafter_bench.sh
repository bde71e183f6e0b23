#!/usr/bin/env bash
# bench/drafter_bench.sh — docs/goals.md's drafter-step benchmark on one GPU, in one run: our step
# (bench_dt_step: dt_model_step + dt_optim_step, BF16 and F32 GEMM modes) and the PyTorch
# reference of §5 with torch.compile'd flex_attention (bench/drafter_flex.py) on the same batch
# layout, at the Qwen3.6-27B drafter shape (deploy/configs/qwen3.6-27b: hidden 5120, 5 layers
# (4 sliding 2048 + 1 full), 32/8 heads x 128, MLP 17408, vocab 248320), 512 anchors x 16, an
# 8192-token context in 4 documents; hidden states are BF16 taps already in GPU memory (the NCCL
# path; the reference's are a bf16 GPU tensor too), plus one run with F32 taps uploaded from the host
# every step (the ZeroMQ and shard paths today). Peak memory: each program's own figure (cudaMemGetInfo /
# torch's allocator) and nvidia-smi sampled every 100 ms while it runs. Then a --profile run of
# ours (every backend entry timed between synchronises). Writes the raw lines to OUT_DIR and a
# markdown report to OUT_DIR/drafter-step.md (copy it to bench/results/drafter-step-<date>.md).
#
# usage: bench/drafter_bench.sh BUILD_DIR OUT_DIR [GPU]
#   env: STEPS (timed steps, default 5), WARMUP (default 2), F32_STEPS (default 2),
#        SKIP_F32=1, SKIP_REF=1, SKIP_PROFILE=1
set -uo pipefail
build=${1:?usage: drafter_bench.sh BUILD_DIR OUT_DIR [GPU]}
out=${2:?usage: drafter_bench.sh BUILD_DIR OUT_DIR [GPU]}
gpu=${3:-0}
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
cfgdir=$root/deploy/configs/qwen3.6-27b
steps=${STEPS:-5} warmup=${WARMUP:-2} f32_steps=${F32_STEPS:-2}
bin=$build/tests/bench_dt_step
mkdir -p "$out"
[[ -x $bin ]] || { echo "drafter_bench: no $bin; build the bench_dt_step target" >&2; exit 1; }

source "$here/drafter_bench_lib.sh"  # sampled, gpu_info

gpu_info
echo "== tandem bf16" >&2
sampled tandem-bf16 "$bin" --drafter-config "$cfgdir/drafter.json" --target-config "$cfgdir/target-config.json" \
    --precision bf16 --steps "$steps" --warmup "$warmup" --gpu "$gpu" --layout "$out/layout.safetensors" \
    >"$out/tandem-bf16.json" 2>"$out/tandem-bf16.err" || echo "tandem bf16 failed: $(tail -3 "$out/tandem-bf16.err")" >&2
echo "== tandem bf16, taps from the host" >&2
sampled tandem-bf16-host "$bin" --drafter-config "$cfgdir/drafter.json" --target-config "$cfgdir/target-config.json" \
    --precision bf16 --steps 3 --warmup 1 --gpu "$gpu" --host-taps \
    >"$out/tandem-bf16-host.json" 2>"$out/tandem-bf16-host.err" || echo "tandem bf16 host failed: $(tail -3 "$out/tandem-bf16-host.err")" >&2
echo "== tandem bf16, taps from pageable host memory" >&2
sampled tandem-bf16-pageable "$bin" --drafter-config "$cfgdir/drafter.json" --target-config "$cfgdir/target-config.json" \
    --precision bf16 --steps 3 --warmup 1 --gpu "$gpu" --host-taps --pageable \
    >"$out/tandem-bf16-pageable.json" 2>"$out/tandem-bf16-pageable.err" || echo "tandem bf16 pageable failed: $(tail -3 "$out/tandem-bf16-pageable.err")" >&2
if [[ -z ${SKIP_REF:-} ]]; then
    echo "== pytorch flex_attention reference" >&2
    sampled ref env CUDA_VISIBLE_DEVICES="$gpu" PYTHONUNBUFFERED=1 python3 "$here/drafter_flex.py" \
        --drafter-config "$cfgdir/drafter.json" --layout "$out/layout.safetensors" --steps "$steps" --warmup "$warmup" \
        >"$out/ref.log" 2>"$out/ref.err" || echo "reference failed: $(tail -3 "$out/ref.err")" >&2
    grep '^{' "$out/ref.log" | tail -1 >"$out/ref.json"
fi
if [[ -z ${SKIP_F32:-} ]]; then
    echo "== tandem fp32" >&2
    sampled tandem-f32 "$bin" --drafter-config "$cfgdir/drafter.json" --target-config "$cfgdir/target-config.json" \
        --precision fp32 --steps "$f32_steps" --warmup 1 --gpu "$gpu" \
        >"$out/tandem-f32.json" 2>"$out/tandem-f32.err" || echo "tandem fp32 failed: $(tail -3 "$out/tandem-f32.err")" >&2
fi
if [[ -z ${SKIP_PROFILE:-} ]]; then
    echo "== tandem bf16 --profile" >&2
    "$bin" --drafter-config "$cfgdir/drafter.json" --target-config "$cfgdir/target-config.json" --precision bf16 \
        --steps 2 --warmup 1 --gpu "$gpu" --profile >"$out/tandem-profile.txt" 2>"$out/tandem-profile.err" ||
        echo "profile failed: $(tail -3 "$out/tandem-profile.err")" >&2
fi

python3 - "$out" <<'EOF'
import json, os, sys
out = sys.argv[1]
def js(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.loads([l for l in f if l.startswith("{")][-1])
    except Exception:
        return None
def smi(name):
    try:
        return float(open(os.path.join(out, name + ".smi")).read().split()[0]) / 1024
    except Exception:
        return None
b, f, r, bh = js("tandem-bf16.json"), js("tandem-f32.json"), js("ref.json"), js("tandem-bf16-host.json")
bp = js("tandem-bf16-pageable.json")
gpu = open(os.path.join(out, "gpu.txt")).read().strip()
L = ["# drafter step: tandem vs PyTorch compiled flex_attention", "",
     f"GPU: {gpu}. Shape: Qwen3.6-27B drafter (deploy/configs/qwen3.6-27b), 8192 tokens in 4 documents, "
     "512 anchors x 16, random weights; both programs train the same batch layout (bench_dt_step --layout).", "",
     "| | step s (median) | TF/s (dt_plan FLOPs) | peak GB (own) | peak GiB (nvidia-smi) |", "|---|---|---|---|---|"]
tf = b["tflop_per_step"] if b else (f["tflop_per_step"] if f else None)
for name, d, own, key in (("tandem bf16", b, "mem_used_gb", "tandem-bf16"),
                          ("tandem bf16, F32 taps uploaded from page-locked host memory", bh, "mem_used_gb", "tandem-bf16-host"),
                          ("tandem bf16, F32 taps uploaded from pageable host memory", bp, "mem_used_gb", "tandem-bf16-pageable"),
                          ("tandem fp32", f, "mem_used_gb", "tandem-f32"),
                          ("pytorch flex (compiled)", r, "peak_reserved_gb", "ref")):
    if not d:
        L.append(f"| {name} | failed or skipped | | | |"); continue
    s = smi(key)
    L.append(f"| {name} | {d['step_s_median']:.4f} | {tf / d['step_s_median']:.0f} | {d[own]:.1f} | "
             + (f"{s:.1f}" if s else "n/a") + " |")
if tf:
    L += ["", f"FLOPs per step (dt_plan's count): {tf:.1f} TFLOP, of which attention {b['tflop_attn'] if b else f['tflop_attn']:.1f}, "
          f"LM head {b['tflop_lm'] if b else f['tflop_lm']:.1f}."]
if b and r:
    L += ["", "Goals (docs/goals.md / issue 7): "
          f"speed-up over the reference {r['step_s_median'] / b['step_s_median']:.2f}x (goal >= 1.5x); "
          f"{tf / b['step_s_median']:.0f} TF/s = {100 * tf / b['step_s_median'] / 790:.0f}% of 790 (goal >= 65%); "
          f"peak {b['mem_used_gb']:.1f} GB (goal <= 40 GB, and less than the reference's {r['peak_reserved_gb']:.1f} GB reserved / "
          f"{r['peak_allocated_gb']:.1f} GB allocated)."]
try:
    L += ["", "Profile of our bf16 step (each backend entry between two synchronises, so the sum exceeds the step):", "", "```",
          open(os.path.join(out, "tandem-profile.txt")).read().rstrip(), "```"]
except Exception:
    pass
L += ["", "Raw lines:", "", "```"] + [json.dumps(x) for x in (b, bh, bp, f, r) if x] + ["```"]
open(os.path.join(out, "drafter-step.md"), "w").write("\n".join(L) + "\n")
print("\n".join(L))
EOF
