#!/usr/bin/env bash
# bench/moe_live_tiny.sh — a drafter trained live from a Qwen3.5-MoE target on the CPU: models/tandem-tiny upcycled
# into OUT_DIR/tiny-moe by bench/make_tiny_moe.py (the dense MLP as the shared expert, 8 routed experts of 32,
# top-2, seeded), checked against the dense model (`target-server dump` of the first 16 held-out documents: relative
# L2 of the hidden states, greedy next-token agreement, each layer's expert shares), served on the cpu, and the DFlash
# drafter of models/tandem-tiny-drafter.json trained live from it for the quickstart's budget (216 steps of
# 1024-token packs, 12 epochs of data/tiny/train.jsonl, lr 3e-3, 64 anchors a pack, a checkpoint every 24 steps);
# then the real τ (`drafter-trainer eval`, greedy, 64 new tokens, the 100 prompts of data/tiny/valid.jsonl) of the
# drafter after step 1 (the same seed's run stopped there: nearly untrained), 24, 72 and 216; the last one also beside
# the target alone, whose greedy tokens it must repeat exactly.
#   usage: bench/moe_live_tiny.sh BUILD_DIR OUT_DIR
set -euo pipefail
build=${1:?usage: moe_live_tiny.sh BUILD_DIR OUT_DIR}
out=${2:?usage: moe_live_tiny.sh BUILD_DIR OUT_DIR}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ts=$build/target-server/target-server
dt=$build/drafter-trainer/drafter-trainer
moe=$out/tiny-moe
mkdir -p "$out"
python3 bench/make_tiny_moe.py "$moe"

# --- the MoE target loads, and is the dense one moved by a few percent
python3 - data/tiny/valid.jsonl "$out/dump-in.safetensors" <<'PY'
import array, json, struct, sys
docs = [json.loads(l)["input_ids"] for l in open(sys.argv[1])][:16]
ids, cu = array.array("i", [t for d in docs for t in d]), array.array("i", [0])
for d in docs:
    cu.append(cu[-1] + len(d))
h = {"input_ids": {"dtype": "I32", "shape": [len(ids)], "data_offsets": [0, 4 * len(ids)]},
     "cu_seqlens": {"dtype": "I32", "shape": [len(cu)], "data_offsets": [4 * len(ids), 4 * (len(ids) + len(cu))]}}
hb = json.dumps(h).encode()
hb += b" " * (-len(hb) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(hb)) + hb + ids.tobytes() + cu.tobytes())
PY
"$ts" dump --model models/tandem-tiny --input "$out/dump-in.safetensors" --out "$out/dump-dense.safetensors" \
    --logits --log-level warn
"$ts" dump --model "$moe" --input "$out/dump-in.safetensors" --out "$out/dump-moe.safetensors" --logits --log-level warn
python3 - "$out/dump-dense.safetensors" "$out/dump-moe.safetensors" <<'PY'
import array, json, math, struct, sys
def load(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h, blob = json.loads(f.read(n)), f.read()
    h.pop("__metadata__", None)
    return {k: (v["shape"], array.array("f" if v["dtype"] == "F32" else "i", blob[slice(*v["data_offsets"])]))
            for k, v in h.items()}
d, m = load(sys.argv[1]), load(sys.argv[2])
def rel(k):
    a, b = d[k][1], m[k][1]
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)) / sum(x * x for x in a))
(T, V), a = d["logits"]
b = m["logits"][1]
top = lambda x, t: max(range(V), key=lambda v: x[t * V + v])
print(f"dense vs MoE over {T} tokens: relative L2 of final_norm {rel('final_norm'):.4f}; of layer_0..7 "
      + " ".join(f"{rel(f'layer_{i}'):.4f}" for i in range(8))
      + f"; greedy next token the same at {sum(top(a, t) == top(b, t) for t in range(T)) / T:.3f} of positions")
for k in sorted(x for x in m if x.startswith("experts_")):
    c = [list(m[k][1]).count(e) / len(m[k][1]) for e in range(8)]
    print(f"{k} share per expert: " + " ".join(f"{x:.2f}" for x in c))
PY

# --- serve it, train live, evaluate
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null || true' EXIT
"$ts" serve --model "$moe" --bind "ipc://$out/moe.ipc" --log-level warn 2>"$out/serve.log" &
pids+=($!)
sleep 1
train() {   # RUN_DIR extra flags...
    local run=$1
    shift
    rm -rf "$run"
    "$dt" train --config models/tandem-tiny-drafter.json --target "$moe" --dataset data/tiny/train.jsonl \
        --token-budget 1024 --server "ipc://$out/moe.ipc" --out "$run" --epochs 12 --lr 3e-3 --max-anchors 64 \
        --progress off --no-tensorboard --log-level warn "$@" >"$run.log" 2>&1
}
train "$out/train-step1" --steps 1
t0=$SECONDS
train "$out/train" --save-every 24
echo "trained from the MoE server in $((SECONDS - t0)) s"
for s in 1 24 72 216; do
    ck=$out/train/checkpoints/step-$s
    [ "$s" = 1 ] && ck=$out/train-step1/checkpoints/step-1
    cmp=()
    [ "$s" = 216 ] && cmp=(--compare-target-only)
    "$dt" eval --checkpoint "$ck" --target "$moe" --server "ipc://$out/moe.ipc" --data data/tiny/valid.jsonl \
        --max-new 64 --batch 8 "${cmp[@]}" --json "$out/eval-step$s.json" --log-level warn >"$out/eval-step$s.log" 2>&1
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
steps = {r["step"]: r for r in map(json.loads, open(f"{out}/train/metrics.jsonl")) if "loss" in r}
one = [json.loads(l) for l in open(f"{out}/train-step1/metrics.jsonl") if '"loss"' in l][0]
assert one["loss"] == steps[1]["loss"], "the step-1 run is not the full run's step 1"
print("| step | loss at the step | mean loss, 18 steps to it | real τ vs the MoE target |")
print("| ---: | ---: | ---: | ---: |")
for s in (1, 24, 72, 216):
    win = [steps[i]["loss"] for i in range(max(1, s - 17), s + 1)]
    tau = json.load(open(f"{out}/eval-step{s}.json"))["overall"]["tau"]
    print(f"| {s} | {steps[s]['loss']:.4f} | {sum(win) / len(win):.4f} | {tau:.3f} |")
alone = json.load(open(f"{out}/eval-step216.json"))["target_only_run"]
print(f"step 216 beside the target alone: outputs identical for {alone['identical']} of {alone['prompts']} prompts")
PY
