#!/usr/bin/env bash
# The main job on the embedded default: installs what is missing, builds, then runs the two
# programs as they run at scale, on the CPU: `target-server serve` loads the embedded tiny
# trained target (models/tandem-tiny) once; `target-server generate` first regenerates the
# answers of the tiny tokenized dataset (data/tiny/train.jsonl) with the target itself (a drafter
# learns the target's own answers best); `drafter-trainer train` then trains a DFlash drafter
# (models/tandem-tiny-drafter.json) live from the server on them, packing the documents into
# 1024-token batches, for 216 steps, and every 54 steps decodes 32 held-out prompts speculatively
# against the same server (`--eval-every`: the real τ, mean tokens per verify step). It ends with
# the teacher-forced τ per epoch, the real τ of the final drafter on all 100 held-out prompts
# beside it, and where the checkpoint is. It builds only the two programs, CPU-only, into
# build-quickstart/ (BUILD_DIR), then runs for a few minutes on two cores. Extra arguments go to
# `drafter-trainer train` (e.g. --epochs 3).
#   OUT_DIR      where the run goes (default /tmp/tandem-quickstart)
#   REGENERATE   1 (default): train on the target's regenerated answers; 0: on the corpus as it is
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/deps.sh
# only the two programs, CPU-only: the CUDA kernels and the test binaries are not needed here
build=${BUILD_DIR:-build-quickstart}
mkdir -p "$build"
echo "quickstart: building target-server and drafter-trainer (CPU-only) into $build/ (about a minute on" \
    "2 cores the first time; compiler output in $build/quickstart-build.log)"
t0=$SECONDS
if ! { cmake -S . -B "$build" -DTANDEM_CUDA=OFF >"$build/quickstart-build.log" 2>&1 &&
    cmake --build "$build" -j "$(nproc)" --target target-server drafter-trainer >>"$build/quickstart-build.log" 2>&1; }; then
    tail -n 30 "$build/quickstart-build.log" >&2
    echo "quickstart: the build failed (above: the end of $build/quickstart-build.log)" >&2
    exit 1
fi
echo "quickstart: built in $((SECONDS - t0)) s"
out=${OUT_DIR:-/tmp/tandem-quickstart}
rm -rf "$out"
mkdir -p "$out"
# the tiny model's kernels gain nothing from threads on a small machine; a busy one loses a lot
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
endpoint="ipc://$out/target.ipc"

data=data/tiny/train.jsonl epochs=12 # 216 steps of its 18 packs
if [ "${REGENERATE:-1}" = 1 ]; then
    echo "quickstart: regenerating the answers of $data with the target (target-server generate, greedy)"
    "./$build/target-server/target-server" generate --model models/tandem-tiny --data "$data" \
        --out "$out/train-regenerated.jsonl" --max-new 96 --log-level warn
    data=$out/train-regenerated.jsonl epochs=9 # 216 steps of its 24 packs
fi

echo "quickstart: serving models/tandem-tiny on $endpoint, then training models/tandem-tiny-drafter.json live" \
    "from it on $data (the progress lines show means over the last 32 steps; the eval lines decode 32 held-out" \
    "prompts speculatively against the same server)"
"./$build/target-server/target-server" serve --model models/tandem-tiny --bind "$endpoint" \
    --log-level warn &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT

"./$build/drafter-trainer/drafter-trainer" train --config models/tandem-tiny-drafter.json \
    --target models/tandem-tiny --dataset "$data" --token-budget 1024 \
    --server "$endpoint" --out "$out/run" --epochs "$epochs" --lr 3e-3 --max-anchors 64 \
    --eval-every 54 --eval-data data/tiny/valid.jsonl --eval-prompts 32 --eval-max-new 48 \
    --progress lines --log-every 18 "$@"

echo "quickstart: the final drafter decoding all 100 held-out prompts of data/tiny/valid.jsonl against the server"
"./$build/drafter-trainer/drafter-trainer" eval --run "$out/run" --target models/tandem-tiny --server "$endpoint" \
    --data data/tiny/valid.jsonl --max-new 64 --batch 8 --compare-target-only --json "$out/eval.json" \
    --log-level warn > "$out/eval.txt"
tail -n 4 "$out/eval.txt"
"./$build/target-server/target-server" status --server "$endpoint"
echo
echo "τ (mean accepted length) by epoch, teacher forced on the training batches, from $out/run/metrics.jsonl:"
awk '/"eval_/ { next }
     {
        if (match($0, /"epoch": [0-9]+/)) e = substr($0, RSTART + 9, RLENGTH - 9) + 0
        if (match($0, /"tau": [0-9.eE+-]+/)) { s[e] += substr($0, RSTART + 7, RLENGTH - 7); n[e]++; lt = e }
        if (e > last) last = e
     }
     END { for (i = 0; i <= last; i++) if (n[i]) printf "  epoch %2d  τ %.2f  (%d steps)\n", i, s[i] / n[i], n[i] }' \
    "$out/run/metrics.jsonl"
echo "real τ during training (speculative decoding of 32 held-out prompts against the server):"
awk 'match($0, /"eval_tau": [0-9.eE+-]+/) { t = substr($0, RSTART + 12, RLENGTH - 12)
                                             match($0, /"step": [0-9]+/); printf "  step %3d  real τ %.3f\n", substr($0, RSTART + 8, RLENGTH - 8), t }' \
    "$out/run/metrics.jsonl"
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
report = json.load(open(f"{out}/eval.json"))
ev, same = report["overall"], report["target_only_run"]["identical"]
taus, last = {}, None
for line in open(f"{out}/run/metrics.jsonl"):
    r = json.loads(line)
    if "tau" in r and "epoch" in r:
        taus.setdefault(r["epoch"], []).append(r["tau"])
        last = r["epoch"]
tf = sum(taus[last]) / len(taus[last])
print(f"final drafter: real τ {ev['tau']:.3f} on the {ev['prompts']} held-out prompts ({ev['generated']} tokens in "
      f"{ev['steps']} verify steps; outputs identical to the target's own decoding on {same} of {ev['prompts']}), "
      f"teacher-forced τ {tf:.3f} in the last epoch")
PY
echo
echo "checkpoint (DFlash serving format, loadable by SGLang and vLLM): $out/run/checkpoints/$(cat "$out/run/checkpoints/latest")"
echo "TensorBoard: tensorboard --logdir $out/run/tb"
