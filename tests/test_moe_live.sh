#!/usr/bin/env bash
# tests/test_moe_live.sh — a drafter learns from a Qwen3.5-MoE target served live, on the CPU: models/tandem-tiny
# upcycled by bench/make_tiny_moe.py (the dense MLP as the shared expert, 8 routed experts, top-2, seeded), served
# by a real `target-server serve` process over ipc, and the DFlash drafter of models/tandem-tiny-drafter.json trained
# from its answers for 72 steps (1024-token packs, lr 3e-3, 64 anchors a pack; bench/moe_live_tiny.sh runs the
# full 216). Checks: the mean loss of the last 18 steps is below the first loss by more than 1; the real τ of
# greedy speculative decoding against the MoE server (`drafter-trainer eval`, 32 held-out prompts, 48 new tokens)
# rises by more than 0.05 from the drafter after step 1 (a run of the same seed stopped there) to the one after
# step 72; and those decodes repeat the target's own greedy tokens exactly (--compare-target-only).
#   usage: tests/test_moe_live.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
cd "$src"
export OMP_NUM_THREADS=1
ts=$build/target-server/target-server
dt=$build/drafter-trainer/drafter-trainer
out=$(mktemp -d /tmp/tandem-moe-live.XXXXXX)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$out"' EXIT
fail() { echo "test_moe_live: FAIL: $*" >&2; exit 1; }

python3 bench/make_tiny_moe.py "$out/tiny-moe" >/dev/null || fail "bench/make_tiny_moe.py"
"$ts" serve --model "$out/tiny-moe" --bind "ipc://$out/moe.ipc" --log-level warn 2>"$out/serve.log" &
pids+=($!)
for _ in $(seq 100); do
    "$ts" status --server "ipc://$out/moe.ipc" --json 2>/dev/null | grep -q '"loaded":true' && break
    sleep 0.1
done
train() { # RUN_DIR extra flags...
    local run=$1
    shift
    "$dt" train --config models/tandem-tiny-drafter.json --target "$out/tiny-moe" --dataset data/tiny/train.jsonl \
        --token-budget 1024 --server "ipc://$out/moe.ipc" --out "$run" --epochs 12 --lr 3e-3 --max-anchors 64 \
        --progress off --no-tensorboard --log-level warn "$@" >"$run.log" 2>&1 || fail "train $run: $(tail -3 "$run.log")"
}
evaluate() { # CHECKPOINT JSON extra flags...
    local ck=$1 json=$2
    shift 2
    "$dt" eval --checkpoint "$ck" --target "$out/tiny-moe" --server "ipc://$out/moe.ipc" --data data/tiny/valid.jsonl \
        --prompts 32 --max-new 48 --batch 8 --json "$json" --log-level warn "$@" >"$json.log" 2>&1 ||
        fail "eval $ck: $(tail -3 "$json.log")"
}
train "$out/step1" --steps 1
train "$out/run" --steps 72
evaluate "$out/step1/checkpoints/step-1" "$out/eval1.json"
evaluate "$out/run/checkpoints/step-72" "$out/eval72.json" --compare-target-only
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
steps = [r for r in map(json.loads, open(f"{out}/run/metrics.jsonl")) if "loss" in r]
one = [r for r in map(json.loads, open(f"{out}/step1/metrics.jsonl")) if "loss" in r]
first, last18 = steps[0]["loss"], sum(r["loss"] for r in steps[-18:]) / 18
t1 = json.load(open(f"{out}/eval1.json"))["overall"]["tau"]
e72 = json.load(open(f"{out}/eval72.json"))
t72, alone = e72["overall"]["tau"], e72["target_only_run"]
print(f"test_moe_live: {len(steps)} steps from the MoE server; loss {first:.4f} at step 1, {last18:.4f} over the "
      f"last 18; real tau {t1:.3f} after step 1, {t72:.3f} after step {steps[-1]['step']}; the decodes equal the "
      f"target's own for {alone['identical']} of {alone['prompts']} prompts")
ok = (len(steps) == 72 and one[0]["loss"] == first and last18 < first - 1.0 and t72 > t1 + 0.05
      and alone["identical"] == alone["prompts"] == 32)
sys.exit(0 if ok else 1)
PY
echo "test_moe_live: ok"
