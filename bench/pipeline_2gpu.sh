#!/usr/bin/env bash
# The pipeline at real scale on two GPUs (issue 9): a 27B-shape target (serve --init random) on GPU 0
# serving the Qwen3.6-27B drafter (train --target-init random) on GPU 1 over NCCL, 8192-token packs of
# random tokens (4 documents of 2048), 512 anchors x 16, 12 steps. Needs a CUDA build (BUILD_DIR, default
# build) and python3; writes the logs, metrics, nvidia-smi samples and a summary to OUT.
#   usage: OUT=/tmp/pipeline-2gpu BUILD_DIR=build bench/pipeline_2gpu.sh
#   env: SERVER_GPU (0; a list such as 0,1 runs one target replica per GPU in the one server),
#        TRAINER_GPU (1), CREDITS (2), ENCODING (nccl; one GPU shared by both: raw over ZeroMQ,
#        since NCCL takes one rank per GPU), STEPS (12), SERVE_ARGS (more serve flags), WORK (/tmp/i9: the
#        dataset and the run; on /dev/shm the final 27 GB checkpoint is written in seconds),
#        SERVER_ENV / TRAINER_ENV (VAR=value words put in that process's environment, e.g.
#        CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=60 under an MPS daemon)
set -u
cd "$(dirname "$0")/.."; OUT=${OUT:-/tmp/pipeline-2gpu}; mkdir -p "$OUT"
B=${BUILD_DIR:-build}; T=${WORK:-/tmp/i9}; rm -rf $T; mkdir -p $T
SG=${SERVER_GPU:-0}; TG=${TRAINER_GPU:-1}; ENC=${ENCODING:-nccl}; STEPS=${STEPS:-12}; CR=${CREDITS:-2}
CFG=deploy/configs/qwen3.6-27b/target-config.json; DR=deploy/configs/qwen3.6-27b/drafter.json
# shellcheck source=bench/drafter_bench_lib.sh
source bench/drafter_bench_lib.sh # random_docs
random_docs "$T/d.jsonl"
nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader,nounits -lms 200 > $OUT/smi.csv &
smi=$!
t0=$(date +%s.%N)
env ${SERVER_ENV:-} $B/target-server/target-server serve --init random --config $CFG --seed 1 --device cuda --gpu $SG ${SERVE_ARGS:-} \
  --bind ipc://$T/s.ipc --max-tokens 8192 --max-layers 5 --credits $CR --stats-interval 0 > $OUT/serve.log 2>&1 &
srv=$!
for i in $(seq 1 300); do $B/target-server/target-server status --server ipc://$T/s.ipc --json 2>/dev/null | grep -q '"loaded":true' && break; sleep 0.2; done
echo "server loaded after $(awk "BEGIN{print $(date +%s.%N) - $t0}") s" > $OUT/summary.txt
t1=$(date +%s.%N)
timeout 300 env ${TRAINER_ENV:-} $B/drafter-trainer/drafter-trainer train --device cuda --gpu $TG --precision bf16 --config $DR \
  --target $CFG --target-init random --target-seed 1 --dataset $T/d.jsonl --token-budget 8192 \
  --server ipc://$T/s.ipc --encoding $ENC --credits $CR --steps $STEPS --max-anchors 512 --out $T/run \
  --progress lines --log-every 1 --no-tensorboard > $OUT/train.log 2>&1
echo "train rc $? wall $(awk "BEGIN{print $(date +%s.%N) - $t1}") s" >> $OUT/summary.txt
$B/target-server/target-server status --server ipc://$T/s.ipc --json > $OUT/status.json 2>&1
kill $srv; wait $srv; kill $smi
cp $T/run/metrics.jsonl $OUT/metrics.jsonl 2>/dev/null
awk -F", " '{ if ($2 > m[$1]) m[$1] = $2; u[$1] += $3; n[$1]++ } END { for (g in m) printf "GPU %s peak %d MiB, mean util %.0f%%\n", g, m[g], u[g]/n[g] }' $OUT/smi.csv >> $OUT/summary.txt
grep -E 'NCCL from|saved|error' $OUT/train.log >> $OUT/summary.txt
# with SERVE_ARGS="--log-level debug": each answer's time on its worker (forward + what is not overlapped)
grep -o 'on worker [0-9]*: [0-9]* tokens, [0-9]* layers in [0-9]* ms' $OUT/serve.log |
  awk '{ w[$3]++; s += $(NF-1); n++ } END { if (n) { printf "server: %d answers, %.0f ms each on its worker (", n, s / n;
    for (k in w) printf "worker %s: %d ", k, w[k]; print ")" } }' >> $OUT/summary.txt
cat $OUT/summary.txt; tail -4 $OUT/train.log
