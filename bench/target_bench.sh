#!/usr/bin/env bash
# bench/target_bench.sh — the target-server at the 27B shape on a GPU machine, in one run:
# our forward (bench_ts_target: cold start, tokens/s on 8192-token packs of a realistic length
# mix, per-block times, the chunked GDN and flash attention kernels alone, the cuBLASLt
# ceiling) and Hugging Face Transformers + FLA on the same pack and the same random-weight
# ranges (bench/hf_fla_bench.py), then the ratio.
#   usage: bench/target_bench.sh BUILD_DIR OUT_DIR
# Environment: OURS_GPU (default 0) and HF_GPU (default 1 when a second GPU is present, else
# the same GPU, run after ours); CONFIG (default the 27B deploy config); TOKENS (8192);
# ITERS (5); PRE_CMD, a command run on our GPU while the Transformers side builds its model
# on the other (the GPU tests, say); UNFUSED=1 also runs our forward on the unfused path
# (TANDEM_TARGET_FUSED=0: f32 GEMM inputs converted by the GEMM, separate add, conv, splits and
# l2norms) into ours-unfused.md/.json, for the before/after of the fused bf16 path; FP8=1 (the
# default) also runs it with --precision fp8 (block-scaled FP8 GEMMs, docs/fp8.md) into
# ours-fp8.md/.json, with both GEMM-only bounds, and prints fp8 / bf16; for a MoE config,
# MOE_LOOP=1 (the default) also runs it with one GEMM per expert (TANDEM_MOE_GEMM=loop) into
# ours-moe-loop.md/.json and prints grouped / per expert, and MOE_TILES=1 (the default) with
# the grouped kernel's other tilings (TANDEM_MOE_GEMM_TILE, the list in MOE_TILE_LIST, default
# "128w4 wg4": the mma.sync kernel and wgmma with 4 stages) into ours-moe-<tiling>;
# SKIP_HF=1 leaves the Transformers side out (its figure from an earlier run stands). FLA comes
# from the flash-linear-attention and fla-core wheels in .whl/, for a GPU machine without network
# (downloaded elsewhere with `pip download --no-deps`): install them first with pip --no-deps into
# a --target directory on PYTHONPATH.
set -uo pipefail
build=${1:?usage: target_bench.sh BUILD_DIR OUT_DIR}
out=${2:?usage: target_bench.sh BUILD_DIR OUT_DIR}
cfg=${CONFIG:-deploy/configs/qwen3.6-27b/target-config.json}
tokens=${TOKENS:-8192}
iters=${ITERS:-5}
mkdir -p "$out"
n_gpu=$(nvidia-smi -L 2>/dev/null | wc -l)
ours_gpu=${OURS_GPU:-0}
hf_gpu=${HF_GPU:-$([ "$n_gpu" -gt 1 ] && echo 1 || echo 0)}
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv | tee "$out/gpus.csv"

"$build/tests/bench_ts_target" --config "$cfg" --tokens "$tokens" --mix-only "$out/pack.json" || exit 1
echo "pack: $(cat "$out/pack.json")"

hf() {
  CUDA_VISIBLE_DEVICES=$hf_gpu PYTHONUNBUFFERED=1 timeout "${HF_TIMEOUT:-300}" \
    python3 bench/hf_fla_bench.py --config "$cfg" --pack "$out/pack.json" --iters 3 --json "$out/hf.json" \
    > "$out/hf.log" 2>&1
  echo "hf_fla_bench exit $?" >> "$out/hf.log"
}
[ "${SKIP_HF:-0}" = 1 ] && hf_gpu=skip
if [ "$hf_gpu" != skip ] && [ "$hf_gpu" != "$ours_gpu" ]; then hf & hf_pid=$!; fi
[ -n "${PRE_CMD:-}" ] && CUDA_VISIBLE_DEVICES=$ours_gpu bash -c "$PRE_CMD"

timev=(); [ -x /usr/bin/time ] && timev=(/usr/bin/time -v)
ours() { # $1: output name, then extra flags; the environment picks the path
  local name=$1; shift
  ${timev[@]+"${timev[@]}"} "$build/tests/bench_ts_target" --config "$cfg" --tokens "$tokens" --iters "$iters" \
    --gpu "$ours_gpu" --json "$out/$name.json" "$@" > "$out/$name.md" 2> "$out/$name.err"
  echo "bench_ts_target exit $?" >> "$out/$name.err"
  cat "$out/$name.md"; grep -E "exit|Maximum resident|Elapsed" "$out/$name.err"
}
ours ours
[ "${FP8:-1}" = 1 ] && ours ours-fp8 --precision fp8
[ "${UNFUSED:-0}" = 1 ] && (export TANDEM_TARGET_FUSED=0; ours ours-unfused)
# a MoE target: also one GEMM per expert (TANDEM_MOE_GEMM=loop), beside the grouped moe_gemm
grep -q '"num_experts"' "$cfg" && [ "${MOE_LOOP:-1}" = 1 ] && (export TANDEM_MOE_GEMM=loop; ours ours-moe-loop)
# and the grouped kernel's other tilings (the default on an H100/H200 is wg: wgmma, 3 stages)
moe_tiles=${MOE_TILE_LIST:-128w4 wg4}
if grep -q '"num_experts"' "$cfg" && [ "${MOE_TILES:-1}" = 1 ]; then
  for t in $moe_tiles; do (export TANDEM_MOE_GEMM_TILE=$t; ours ours-moe-$t); done
fi

if [ "$hf_gpu" = skip ]; then :; elif [ "$hf_gpu" != "$ours_gpu" ]; then wait "$hf_pid"; else hf; fi
[ "$hf_gpu" != skip ] && cat "$out/hf.log"

python3 - "$out" "$moe_tiles" <<'PY'
import json, sys
out = sys.argv[1]
try:
    ours = json.load(open(f"{out}/ours.json"))
except Exception as e:
    print("no ours.json:", e); sys.exit(0)
print(f"\nours: {ours['tokens_per_s']:.0f} tok/s ({ours['forward_ms']:.1f} ms per {ours['tokens']}-token pack)")
try:
    f8 = json.load(open(f"{out}/ours-fp8.json"))
    print(f"ours, fp8: {f8['tokens_per_s']:.0f} tok/s ({f8['forward_ms']:.1f} ms); fp8 / bf16 = "
          f"{f8['tokens_per_s'] / ours['tokens_per_s']:.3f}x; GEMM-only bounds bf16 {f8['bound_bf16_ms']:.1f} ms, "
          f"fp8 {f8['bound_fp8_ms']:.1f} ms (ceilings {f8['ceiling_tflops']:.0f} and {f8['ceiling_fp8_tflops']:.0f} "
          f"TF/s); fp8 forward at {100 * f8['bound_fp8_ms'] / f8['forward_ms']:.0f} % of its bound, bf16 at "
          f"{100 * ours['bound_bf16_ms'] / ours['forward_ms']:.0f} %")
except Exception:
    pass
try:
    un = json.load(open(f"{out}/ours-unfused.json"))
    print(f"ours, unfused path: {un['tokens_per_s']:.0f} tok/s ({un['forward_ms']:.1f} ms); "
          f"fused / unfused = {ours['tokens_per_s'] / un['tokens_per_s']:.3f}x")
except Exception:
    pass
try:
    lp = json.load(open(f"{out}/ours-moe-loop.json"))
    print(f"ours, one GEMM per expert: {lp['tokens_per_s']:.0f} tok/s ({lp['forward_ms']:.1f} ms; experts' GEMMs "
          f"{lp['expert_gemm_ms_per_forward']:.1f} ms timed); grouped / per expert = "
          f"{ours['tokens_per_s'] / lp['tokens_per_s']:.2f}x (grouped experts' GEMMs "
          f"{ours['expert_gemm_ms_per_forward']:.1f} ms timed)")
except Exception:
    pass
try:
    for t in sys.argv[2].split():
        v = json.load(open(f"{out}/ours-moe-{t}.json"))
        print(f"ours, grouped with tiling {t}: {v['tokens_per_s']:.0f} tok/s ({v['forward_ms']:.1f} ms; experts' "
              f"GEMMs {v['expert_gemm_ms_per_forward']:.1f} ms timed) against the default: "
              f"{ours['forward_ms']:.1f} ms, {ours['expert_gemm_ms_per_forward']:.1f} ms")
except Exception:
    pass
try:
    hf = json.load(open(f"{out}/hf.json"))
except Exception as e:
    print("no hf.json:", e); sys.exit(0)
for mode, r in hf["modes"].items():
    if "forward_ms" in r:
        print(f"transformers {hf['transformers']} + fla {hf['fla']} ({mode}): {r['tokens_per_s']:.0f} tok/s "
              f"({r['forward_ms']:.1f} ms); ours / theirs = {ours['tokens_per_s'] / r['tokens_per_s']:.2f}x")
    else:
        print(f"transformers ({mode}): {r.get('error')}")
PY
