#!/usr/bin/env bash
# The main job on the embedded default: installs what is missing, builds, and runs the frozen
# target forward (target-server dump) over the tiny built-in Qwen3.5 model in models/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/deps.sh
bash scripts/build.sh
out=${OUT_FILE:-/tmp/tandem-quickstart.safetensors}
./build/target-server/target-server dump --model models/tiny-qwen35 \
    --input models/tiny-qwen35/example_input.safetensors --out "$out" --logits "$@"
python3 - "$out" <<'PY' 2>/dev/null || echo "wrote $out"
import json, struct, sys
with open(sys.argv[1], "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    hdr = json.loads(f.read(n))
for k, v in hdr.items():
    if k != "__metadata__":
        print(f"{k:14s} {v['dtype']} {v['shape']}")
PY
