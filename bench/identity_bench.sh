#!/usr/bin/env bash
# The cold start of `serve` with the weights fingerprint (this build) against a build from
# before it, on a GPU machine, at the 27B shape: `--init random` (no checkpoint), then a
# random-weights checkpoint in the real layout written by bench/make_checkpoint.py (53.8 GB).
# Each start is timed from launch to the log's "model ready" line (load + the warm-up forward
# over --max-tokens 8192), alternating the two binaries; with the page cache dropped before a
# start where the machine lets us (then "cold"), else "warm". The new binary's own log line
# gives the hashing time and rate.
#   usage: bench/identity_bench.sh NEW_SERVER OLD_SERVER OUT_DIR [CKPT_DIR]
set -uo pipefail
new=$1 old=$2 out=$3 ck=${4:-}
cfg=deploy/configs/qwen3.6-27b/target-config.json
mkdir -p "$out"
sum="$out/identity-summary.txt"
: >"$sum"

can_drop=0
if sync && echo 3 >/proc/sys/vm/drop_caches 2>/dev/null; then can_drop=1; fi
echo "page cache can be dropped: $can_drop" | tee -a "$sum"

# start BIN TAG DROP ARGS...: seconds from launch to "model ready"
start() {
  local bin=$1 tag=$2 drop=$3
  shift 3
  local log="$out/serve-$tag.log"
  [ "$drop" = 1 ] && [ "$can_drop" = 1 ] && sync && echo 3 >/proc/sys/vm/drop_caches
  local t0 t1
  t0=$(date +%s.%N)
  "$bin" serve --device cuda --bind 'tcp://127.0.0.1:*' --max-tokens 8192 --stats-interval 0 "$@" >"$log" 2>&1 &
  local pid=$!
  while ! grep -q "model ready" "$log" 2>/dev/null; do
    kill -0 $pid 2>/dev/null || { echo "$tag: serve exited" | tee -a "$sum"; tail -5 "$log" >>"$sum"; return; }
    sleep 0.02
  done
  t1=$(date +%s.%N)
  kill -TERM $pid
  wait $pid
  local fp
  fp=$(grep -o "weights fingerprint.*" "$log" | head -1)
  awk -v a="$t0" -v b="$t1" -v t="$tag" -v f="$fp" 'BEGIN { printf "%-28s %7.2f s  %s\n", t, b - a, f }' | tee -a "$sum"
}

for i in 1 2; do
  start "$old" "random-old-$i" 0 --init random --config "$cfg"
  start "$new" "random-new-$i" 0 --init random --config "$cfg"
done
[ -n "$ck" ] || exit 0
if [ ! -f "$ck/model.safetensors.index.json" ]; then
  df -h "$(dirname "$ck")" | tee -a "$sum"
  python3 bench/make_checkpoint.py "$cfg" "$ck" 2>&1 | tee -a "$sum"
fi
du -sh "$ck" | tee -a "$sum"
kind=$([ "$can_drop" = 1 ] && echo cold || echo warm)
for i in 1 2; do
  start "$old" "ckpt-$kind-old-$i" 1 --model "$ck"
  start "$new" "ckpt-$kind-new-$i" 1 --model "$ck"
done
start "$old" "ckpt-warm-old" 0 --model "$ck"
start "$new" "ckpt-warm-new" 0 --model "$ck"
