#!/usr/bin/env bash
# The main job on the embedded default: installs what is missing, builds, then runs the two
# programs as they run at scale, on the CPU: `target-server serve` loads the embedded tiny
# trained target (models/tandem-tiny) once, and `drafter-trainer train` trains a DFlash drafter
# (models/tandem-tiny-drafter.json) live from it on the tiny tokenized dataset (data/tiny),
# packing its documents into 1024-token batches. It ends by printing τ (mean accepted length) per
# epoch, which rises from about 1.1 to about 2 over the 12 epochs, and where the checkpoint is. It
# builds only the two programs, CPU-only, into build-quickstart/ (BUILD_DIR), then trains for a few
# minutes on two cores (216 steps). Extra arguments go to `drafter-trainer train` (e.g. --epochs 3).
#   OUT_DIR   where the run goes (default /tmp/tandem-quickstart)
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

echo "quickstart: serving models/tandem-tiny on $endpoint, then training models/tandem-tiny-drafter.json live" \
    "from it (the progress lines show means over the last 32 steps)"
"./$build/target-server/target-server" serve --model models/tandem-tiny --bind "$endpoint" \
    --log-level warn &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT

"./$build/drafter-trainer/drafter-trainer" train --config models/tandem-tiny-drafter.json \
    --target models/tandem-tiny --dataset data/tiny/train.jsonl --token-budget 1024 \
    --server "$endpoint" --out "$out/run" --epochs 12 --lr 3e-3 --max-anchors 64 \
    --progress lines --log-every 18 "$@"

"./$build/target-server/target-server" status --server "$endpoint"
echo
echo "τ (mean accepted length) by epoch, from $out/run/metrics.jsonl:"
awk '{
        if (match($0, /"epoch": [0-9]+/)) e = substr($0, RSTART + 9, RLENGTH - 9) + 0
        if (match($0, /"tau": [0-9.eE+-]+/)) { s[e] += substr($0, RSTART + 7, RLENGTH - 7); n[e]++ }
        if (e > last) last = e
     }
     END { for (i = 0; i <= last; i++) if (n[i]) printf "  epoch %2d  τ %.2f  (%d steps)\n", i, s[i] / n[i], n[i] }' \
    "$out/run/metrics.jsonl"
echo
echo "checkpoint (DFlash serving format, loadable by SGLang and vLLM): $out/run/checkpoints/$(cat "$out/run/checkpoints/latest")"
echo "TensorBoard: tensorboard --logdir $out/run/tb"
