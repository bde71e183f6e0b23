#!/usr/bin/env bash
# bench/fp8_live_tiny.sh — a drafter trained live from an FP8 target beside the same run from the bf16 one, on the
# embedded tiny target (CPU): `target-server serve` of models/tandem-tiny at --precision bf16 and at --precision fp8
# (its projections quantized on load in 128 x 128 blocks, inputs in 1 x 128 groups: docs/fp8.md), the DFlash
# drafter of models/tandem-tiny-drafter.json trained from each for the quickstart's budget (216 steps of 1024-token
# packs, 12 epochs of data/tiny/train.jsonl, lr 3e-3, 64 anchors a pack), then every drafter's real τ against both
# targets (`drafter-trainer eval`, greedy, 64 new tokens, the 100 held-out prompts of data/tiny/valid.jsonl).
#   usage: bench/fp8_live_tiny.sh BUILD_DIR OUT_DIR
set -euo pipefail
build=${1:?usage: fp8_live_tiny.sh BUILD_DIR OUT_DIR}
out=${2:?usage: fp8_live_tiny.sh BUILD_DIR OUT_DIR}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ts=$build/target-server/target-server
dt=$build/drafter-trainer/drafter-trainer
mkdir -p "$out"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null || true' EXIT
for p in bf16 fp8; do
    "$ts" serve --model models/tandem-tiny --precision "$p" --bind "ipc://$out/$p.ipc" --log-level warn \
        2>"$out/serve-$p.log" &
    pids+=($!)
done
sleep 1
for p in bf16 fp8; do
    rm -rf "$out/train-$p"
    t0=$SECONDS
    "$dt" train --config models/tandem-tiny-drafter.json --target models/tandem-tiny --dataset data/tiny/train.jsonl \
        --token-budget 1024 --server "ipc://$out/$p.ipc" --out "$out/train-$p" --epochs 12 --lr 3e-3 \
        --max-anchors 64 --progress off --no-tensorboard --log-level warn >"$out/train-$p.log" 2>&1
    echo "trained from the $p server in $((SECONDS - t0)) s"
    for e in bf16 fp8; do
        "$dt" eval --run "$out/train-$p" --target models/tandem-tiny --server "ipc://$out/$e.ipc" \
            --data data/tiny/valid.jsonl --max-new 64 --batch 8 --json "$out/eval-$p-on-$e.json" --log-level warn \
            >"$out/eval-$p-on-$e.log" 2>&1
    done
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def losses(p):
    recs = [json.loads(l) for l in open(f"{out}/train-{p}/metrics.jsonl") if '"loss"' in l]
    steps = [r for r in recs if "step" in r and "loss" in r]
    last = steps[-18:]
    return steps[0]["loss"], sum(r["loss"] for r in last) / len(last), steps[-1]["step"]
print("| trained from | steps | first loss | mean loss, last 18 steps | real τ vs the bf16 target | real τ vs the fp8 target |")
print("| --- | ---: | ---: | ---: | ---: | ---: |")
for p in ("bf16", "fp8"):
    first, last, n = losses(p)
    tau = {e: json.load(open(f"{out}/eval-{p}-on-{e}.json"))["overall"]["tau"] for e in ("bf16", "fp8")}
    print(f"| {p} server | {n} | {first:.4f} | {last:.4f} | {tau['bf16']:.3f} | {tau['fp8']:.3f} |")
PY
