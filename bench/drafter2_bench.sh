#!/usr/bin/env bash
# bench/drafter2_bench.sh — the DFlash2 drafter-step benchmark on one GPU, in one run: our step
# (bench_dt_step --config the DFlash2 drafter: dt_model_step + dt_optim_step) and the PyTorch reference
# (bench/drafter2_flex.py: compiled flex_attention, dynamic convolutions, candidate selector, chunked
# checkpointed CE with the top-K inside it, fused AdamW) on the same batch layout, at the Qwen3.6-27B
# DFlash2 shape (deploy/configs/qwen3.6-27b-dflash2: hidden 5120, 5 non-causal sliding-2048 layers,
# 32/8 heads x 128, MLP 17408, vocab 248320, Kc 2, G 16, R 256, K 16), 512 anchors x 8, an 8192-token
# context in 4 documents, BF16 taps already in GPU memory on both sides. Peak memory: each program's own
# figure and nvidia-smi sampled every 100 ms. Then optionally our F32 mode and a --profile run of ours.
# Writes the raw lines to OUT_DIR and a markdown report to OUT_DIR/drafter2-step.md (copy it to
# bench/results/drafter2-step-<date>.md).
#
# usage: bench/drafter2_bench.sh BUILD_DIR OUT_DIR [GPU]
#   env: STEPS (timed steps, default 5), WARMUP (default 2), F32_STEPS (default 2), ALPHA (the reference's
#        selector weight, default 1), SELECTOR_MISSING (inject | drop, default inject),
#        SKIP_F32=1, SKIP_REF=1, SKIP_PROFILE=1; for trying the script itself at another shape:
#        DRAFTER_CONFIG (default the 27B DFlash2 drafter.json), REF_ARGS (more flags for drafter2_flex.py);
#        REPORT_ONLY=1 rewrites the report from what OUT_DIR holds, running nothing
set -uo pipefail
build=${1:?usage: drafter2_bench.sh BUILD_DIR OUT_DIR [GPU]}
out=${2:?usage: drafter2_bench.sh BUILD_DIR OUT_DIR [GPU]}
gpu=${3:-0}
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
cfg=${DRAFTER_CONFIG:-$root/deploy/configs/qwen3.6-27b-dflash2/drafter.json}
tcfg=$root/deploy/configs/qwen3.6-27b/target-config.json  # the same 27B target (the DFlash2 folder has no copy)
steps=${STEPS:-5} warmup=${WARMUP:-2} f32_steps=${F32_STEPS:-2}
alpha=${ALPHA:-1} missing=${SELECTOR_MISSING:-inject}
shape=(--tokens 8192 --docs 4 --anchors 512)  # bench_dt_step's defaults, stated
bin=$build/tests/bench_dt_step
mkdir -p "$out"
[[ -x $bin || -n ${REPORT_ONLY:-} ]] || { echo "drafter2_bench: no $bin; build the bench_dt_step target" >&2; exit 1; }
source "$here/drafter_bench_lib.sh"  # sampled, gpu_info

if [[ -z ${REPORT_ONLY:-} ]]; then
    gpu_info
    # results of an earlier run in OUT_DIR must not reach this report
    rm -f "$out"/{layout.safetensors,layout.src,tandem-bf16.json,tandem-bf16.err} \
        "$out"/{tandem-f32.json,tandem-f32.err,ref.json,ref.log,ref.err,tandem-profile.txt,tandem-profile.err,*.smi}
    echo "== tandem bf16 (DFlash2)" >&2
    sampled tandem-bf16 "$bin" --drafter-config "$cfg" --target-config "$tcfg" --precision bf16 \
        --steps "$steps" --warmup "$warmup" --gpu "$gpu" "${shape[@]}" --layout "$out/layout.safetensors" \
        >"$out/tandem-bf16.json" 2>"$out/tandem-bf16.err" || echo "tandem bf16 failed: $(tail -3 "$out/tandem-bf16.err")" >&2
    [[ -s $out/layout.safetensors ]] && echo "bench_dt_step --config qwen3.6-27b-dflash2/drafter.json" >"$out/layout.src"
    if [[ -z ${SKIP_REF:-} && -s $out/layout.safetensors ]]; then
        echo "== pytorch reference (DFlash2, compiled flex_attention)" >&2
        sampled ref env CUDA_VISIBLE_DEVICES="$gpu" PYTHONUNBUFFERED=1 python3 "$here/drafter2_flex.py" \
            --drafter-config "$cfg" --layout "$out/layout.safetensors" --steps "$steps" --warmup "$warmup" \
            --alpha "$alpha" --selector-missing "$missing" ${REF_ARGS:-} \
            >"$out/ref.log" 2>"$out/ref.err" || echo "reference failed: $(tail -3 "$out/ref.err")" >&2
        grep '^{' "$out/ref.log" | tail -1 >"$out/ref.json"
    fi
    if [[ -z ${SKIP_F32:-} ]]; then
        echo "== tandem fp32 (DFlash2)" >&2
        sampled tandem-f32 "$bin" --drafter-config "$cfg" --target-config "$tcfg" --precision fp32 \
            --steps "$f32_steps" --warmup 1 --gpu "$gpu" "${shape[@]}" \
            >"$out/tandem-f32.json" 2>"$out/tandem-f32.err" || echo "tandem fp32 failed: $(tail -3 "$out/tandem-f32.err")" >&2
    fi
    if [[ -z ${SKIP_PROFILE:-} ]]; then
        echo "== tandem bf16 --profile (DFlash2)" >&2
        "$bin" --drafter-config "$cfg" --target-config "$tcfg" --precision bf16 --steps 2 --warmup 1 --gpu "$gpu" \
            "${shape[@]}" --profile >"$out/tandem-profile.txt" 2>"$out/tandem-profile.err" ||
            echo "profile failed: $(tail -3 "$out/tandem-profile.err")" >&2
    fi
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
def err(name):
    try:
        lines = [l.strip() for l in open(os.path.join(out, name)) if l.strip()]
        return lines[-1] if lines else ""
    except Exception:
        return ""
def read(name, default=""):
    try:
        return open(os.path.join(out, name)).read().strip()
    except Exception:
        return default
b, f, r = js("tandem-bf16.json"), js("tandem-f32.json"), js("ref.json")
sh = r or b or {}
L = ["# DFlash2 drafter step: tandem vs PyTorch compiled flex_attention", "",
     f"GPU: {read('gpu.txt', 'unknown')}. Shape: Qwen3.6-27B DFlash2 drafter (deploy/configs/qwen3.6-27b-dflash2: "
     "5 non-causal sliding-2048 layers, Kc 2, G 16, R 256, K 16), "
     f"{sh.get('tokens', 8192)} tokens in {sh.get('docs', 4)} documents, {sh.get('anchors', 512)} anchors x "
     f"{sh.get('block', 8)}, "
     "random weights (convolutions at their identity init), BF16 taps in GPU memory; both programs train the same "
     f"batch layout (written by {read('layout.src', 'nothing: no layout')}).", ""]
# one FLOP count for every row: the reference's estimate (dt_plan's method + the convolutions' projections and
# the selector), else dt_plan's own count from bench_dt_step
tf = r["tflop_per_step_est"] if r else (b or f or {}).get("tflop_per_step")
tf_src = "the reference's estimate" if r else "dt_plan's count (bench_dt_step)"
L += ["| | step s (median) | TF/s | peak GB (own) | peak GiB (nvidia-smi) |", "|---|---|---|---|---|"]
for name, d, key, errf in (("tandem bf16", b, "tandem-bf16", "tandem-bf16.err"),
                           ("tandem fp32", f, "tandem-f32", "tandem-f32.err"),
                           ("pytorch flex (compiled), DFlash2", r, "ref", "ref.err")):
    if not d:
        why = err(errf)
        L.append(f"| {name} | failed or skipped{': ' + why.replace('|', '/') if why else ''} | | | |")
        continue
    own = (f"{d['mem_used_gb']:.1f}" if "mem_used_gb" in d else
           f"{d['peak_allocated_gb']:.1f} allocated, {d['peak_reserved_gb']:.1f} reserved" if "peak_reserved_gb" in d
           else f"{d.get('peak_rss_gb', 0):.1f} (host RSS: not a GPU run)")
    s = smi(key)
    L.append(f"| {name} | {d['step_s_median']:.4f} | " + (f"{tf / d['step_s_median']:.0f}" if tf else "n/a") +
             f" | {own} | " + (f"{s:.1f}" if s else "n/a") + " |")
L += [""]
if tf:
    L.append(f"TF/s from {tf_src}: {tf:.1f} TFLOP per step for every row.")
if r:
    L.append(f"Reference estimate: {r['tflop_per_step_est']:.1f} TFLOP (attention {r['tflop_attn_est']:.1f}, LM head "
             f"{r['tflop_lm_est']:.1f}); selector alpha {r['alpha']}, a target outside the top-K: {r['selector_missing']}; "
             f"losses {r['loss_first']:.4f} -> {r['loss_last']:.4f}; after the steps {r.get('after')}.")
if b:
    L.append(f"dt_plan's count (bench_dt_step): {b['tflop_per_step']:.1f} TFLOP (attention {b['tflop_attn']:.1f}, "
             f"LM head {b['tflop_lm']:.1f}); losses {b['loss_first']:.4f} -> {b['loss_last']:.4f}.")
if b and r and "peak_reserved_gb" in r:
    L += ["", f"Ratio: the reference's step / ours = {r['step_s_median'] / b['step_s_median']:.2f}x (goal "
          f">= 1.3x); ours {tf / b['step_s_median']:.0f} TF/s = {100 * tf / b['step_s_median'] / 790:.0f}% of 790; "
          f"peak {b['mem_used_gb']:.1f} GB against the reference's {r['peak_reserved_gb']:.1f} GB reserved / "
          f"{r['peak_allocated_gb']:.1f} GB allocated "
          f"({b['mem_used_gb'] / r['peak_reserved_gb']:.2f}x of reserved)."]
elif r:
    L += ["", "No ratio: our DFlash2 step did not run (see the table)."]
prof = read("tandem-profile.txt")
if prof:
    L += ["", "Profile of our bf16 step (each backend entry between two synchronises, so the sum exceeds the step):",
          "", "```", prof, "```"]
L += ["", "Raw lines:", "", "```"] + [json.dumps(x) for x in (b, f, r) if x] + ["```"]
open(os.path.join(out, "drafter2-step.md"), "w").write("\n".join(L) + "\n")
print("\n".join(L))
EOF
