#!/usr/bin/env bash
# bench/decode_bench.sh — decoding on the target at the 27B shape, one GPU, in one run: ours (bench_ts_decode:
# prefill, target-only decoding and verification steps of B = 8 and 16 tokens at 1, 8 and 32 sequences) and
# Hugging Face Transformers + FLA on the same batch shapes and weight ranges (bench/hf_decode_bench.py), one after
# the other (each holds a 27B model), then the table side by side.
#   usage: bench/decode_bench.sh BUILD_DIR OUT_DIR
# Environment: CONFIG (default the 27B deploy config), PROMPT (512), SEQS (1,8,32), BLOCKS (8,16), STEPS (16),
# SKIP_HF=1 (ours only). FLA as for bench/target_bench.sh (wheels in .whl/ on PYTHONPATH).
set -uo pipefail
build=${1:?usage: decode_bench.sh BUILD_DIR OUT_DIR}
out=${2:?usage: decode_bench.sh BUILD_DIR OUT_DIR}
cfg=${CONFIG:-deploy/configs/qwen3.6-27b/target-config.json}
args=(--config "$cfg" --prompt "${PROMPT:-512}" --seqs "${SEQS:-1,8,32}" --blocks "${BLOCKS:-8,16}"
      --steps "${STEPS:-16}")
mkdir -p "$out"
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$out/gpus.csv"
"$build/tests/bench_ts_decode" "${args[@]}" --json "$out/ours.json" 2>&1 | tee "$out/ours.log"
if [ "${SKIP_HF:-0}" != 1 ]; then
  PYTHONUNBUFFERED=1 timeout "${HF_TIMEOUT:-420}" python3 bench/hf_decode_bench.py "${args[@]}" \
    --json "$out/hf.json" 2>&1 | tee "$out/hf.log"
fi
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
ours = {(r["seqs"], r["block"]): r for r in json.load(open(f"{out}/ours.json"))["results"]}
try:
    hf = json.load(open(f"{out}/hf.json"))
    theirs = {(r["seqs"], r["block"]): r for r in hf["results"] if "ms" in r}
    print(f"\ntransformers {hf['transformers']} + fla {hf['fla']}")
except Exception as e:
    theirs = {}
    print("no hf.json:", e)
print("| sequences | step | ours ms | Transformers + FLA ms | ours / theirs |")
print("| ---: | --- | ---: | ---: | ---: |")
for (n, b), r in sorted(ours.items()):
    what = "target-only (1 token)" if b == 1 else f"verify B = {b}"
    t = theirs.get((n, b))
    tm = f"{t['ms']:.2f}" if t else "-"
    ratio = f"{t['ms'] / r['ms']:.2f}x faster" if t else "-"
    print(f"| {n} | {what} | {r['ms']:.2f} | {tm} | {ratio} |")
PY
