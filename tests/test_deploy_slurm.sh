#!/usr/bin/env bash
# tests/test_deploy_slurm.sh — deploy/slurm/tandem-task, the per-task half of the Slurm job, run
# for real on the CPU with the tiny target and the variables Slurm would give each task
# (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS): `keys` makes the CURVE pairs once and keeps them;
# two loopback servers bind TANDEM_BASE_PORT + SLURM_LOCALID (the second over two GPUs as two
# pipeline stages, TANDEM_SERVER_STAGES=2) and `wait-servers 2` sees both ready; trainer ranks 0
# and 1 of 2 each train on both servers, their own first, into rank-<r>/ and a rerun
# (a requeued job) resumes; a server bound to a non-loopback address uses the CURVE keys, and a
# trainer against it either connects with the keys or, while drafter-trainer lacks
# --curve-server-key, stops with the message that says so; wait-servers fails when the server
# step dies; SIGTERM stops every server with exit 0. The batch script itself needs Slurm and is
# not run here. Usage: test_deploy_slurm.sh SOURCE_DIR BINARY_DIR
set -euo pipefail

src=$1
. "$src/tests/deploy_tiny_job.sh" # tiny_job_files
export TANDEM_BIN=$2
task=$src/deploy/slurm/tandem-task
tmp=$(mktemp -d /tmp/tandem-slurm-XXXXXX)
fails=0 pids=()
check() {
    local what=$1
    shift
    if "$@"; then echo "ok: $what"; else
        echo "FAILED: $what"
        fails=$((fails + 1))
    fi
}
cleanup() {
    local p
    for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    if ((fails == 0)); then rm -rf "$tmp"; else echo "kept $tmp"; fi
}
trap cleanup EXIT

export OMP_NUM_THREADS=1 TANDEM_DEVICE=cpu TANDEM_MODEL=$src/models/tiny-qwen35
export TANDEM_OUT=$tmp/run TANDEM_KEYS=$tmp/keys TANDEM_STATE=$tmp/state TANDEM_READY_TIMEOUT=60
export TANDEM_DRAFTER_CONFIG=$tmp/drafter.json TANDEM_SERVE_ARGS="--stats-interval 0"
# below the ephemeral range (32768 up), where other tests' connections take their ports, and above
# test_deploy_slurm_real's (10000-19999); skips ports that something already uses
used=" $(ss -Htan 2>/dev/null | awk '{ n = split($4, a, ":"); printf "%s ", a[n] }') "
port=$((20000 + ($$ * 13) % 11990))
for _ in $(seq 1 50); do
    [[ $used == *" $port "* || $used == *" $((port + 1)) "* || $used == *" $((port + 2)) "* ]] || break
    port=$((20000 + (port - 20000 + 7919) % 11990))
done
export TANDEM_BASE_PORT=$port
unset CUDA_VISIBLE_DEVICES SLURM_JOB_ID SLURM_NTASKS_PER_NODE

tiny_job_files "$tmp"
train_args="--dataset $tmp/data.jsonl --token-budget 128 --max-anchors 16 --seed 3 --timeout-ms 60000"

# ---- keys, made once
curve=1
if "$task" keys >"$tmp/keys.out" 2>&1; then
    check "keys: server and trainer pairs, the trainer's public key in clients/" \
        test -s "$TANDEM_KEYS/server.key" -a -s "$TANDEM_KEYS/trainer.key" -a -s "$TANDEM_KEYS/clients/trainer.pub"
    check "keys: directory private" test "$(stat -c %a "$TANDEM_KEYS")" = 700
    before=$(cat "$TANDEM_KEYS/server.key")
    "$task" keys >/dev/null 2>&1
    check "keys: a second call keeps the keys" test "$before" = "$(cat "$TANDEM_KEYS/server.key")"
else
    echo "skipping the CURVE checks: $(cat "$tmp/keys.out")"
    curve=0
fi

# ---- two loopback servers, as server tasks 0 and 1 of one node; server 1 over two "GPUs" as two
# pipeline stages (TANDEM_SERVER_STAGES=2, the node's GPUs 0-3 in view: task 1 takes 2 and 3)
SLURM_PROCID=0 SLURM_LOCALID=0 TANDEM_BIND_ADDR=127.0.0.1 "$task" server &
pids+=("$!")
SLURM_PROCID=1 SLURM_LOCALID=1 TANDEM_BIND_ADDR=127.0.0.1 TANDEM_SERVER_STAGES=2 CUDA_VISIBLE_DEVICES=0,1,2,3 \
    "$task" server &
pids+=("$!")
st=0
"$task" wait-servers 2 "${pids[0]}" >"$tmp/wait.out" 2>&1 || st=$?
check "wait-servers: both ready" test "$st" -eq 0
check "server 1 bound TANDEM_BASE_PORT + SLURM_LOCALID" grep -qx "tcp://127.0.0.1:$((port + 1))" \
    "$TANDEM_STATE/endpoints/server-1"
check "server 1: its group of GPUs, 2 and 3" grep -q "CUDA_VISIBLE_DEVICES=2,3" "$TANDEM_STATE/logs/server-1.log"
check "server 1: two stages" grep -q "replica 0, stage 1: layers" "$TANDEM_STATE/logs/server-1.log"

# ---- trainer ranks 0 and 1 of 2, at once
tpids=()
for r in 0 1; do
    SLURM_PROCID=$r SLURM_LOCALID=$r SLURM_NTASKS=2 TANDEM_TRAIN_ARGS="$train_args --steps 2" "$task" trainer &
    tpids+=("$!")
done
for r in 0 1; do
    st=0
    wait "${tpids[r]}" || st=$?
    check "trainer rank $r: exit 0" test "$st" -eq 0
    check "trainer rank $r: 2 steps in rank-$r/" test "$(wc -l <"$TANDEM_OUT/rank-$r/metrics.jsonl" 2>/dev/null)" = 2
    # every server, from its own on: rank 0 on 0 then 1, rank 1 on 1 then 0
    check "trainer rank $r: on both servers, server $r first" \
        grep -q "rank $r of 2, servers tcp://127.0.0.1:$((port + r)),tcp://127.0.0.1:$((port + 1 - r))," \
        "$TANDEM_STATE/logs/trainer-$r.log"
done
st=0
SLURM_PROCID=1 SLURM_LOCALID=1 SLURM_NTASKS=2 TANDEM_TRAIN_ARGS="$train_args --steps 3" "$task" trainer || st=$?
check "a requeued rank 1 resumes from its checkpoint" test "$st" -eq 0
check "rank 1 resumed (log) and has 3 steps" grep -q "resuming" "$TANDEM_STATE/logs/trainer-1.log"
check "rank 1: 3 steps" test "$(wc -l <"$TANDEM_OUT/rank-1/metrics.jsonl")" = 3

# ---- a server for other hosts: non-loopback address, CURVE keys
addr=""
for a in $(hostname -I 2>/dev/null); do
    if [[ $a =~ ^[0-9.]+$ && $a != 127.* ]]; then
        addr=$a
        break
    fi
done
if ((curve)) && [[ -n $addr ]]; then
    export TANDEM_STATE=$tmp/state-curve
    SLURM_PROCID=0 SLURM_LOCALID=2 TANDEM_BIND_ADDR=$addr "$task" server &
    pids+=("$!")
    st=0
    "$task" wait-servers 1 "${pids[2]}" >"$tmp/wait-curve.out" 2>&1 || st=$?
    check "CURVE server on $addr ready" test "$st" -eq 0
    check "CURVE server bound $addr" grep -qx "tcp://$addr:$((port + 2))" "$TANDEM_STATE/endpoints/server-0"
    # (serve refuses a non-loopback bind without them, so binding at all says they were given)
    check "CURVE server given the keys" grep -q -- "--curve-client-keys $TANDEM_KEYS/clients" \
        <(tr '\0' ' ' <"/proc/${pids[2]}/cmdline")
    st=0
    SLURM_PROCID=0 SLURM_NTASKS=1 TANDEM_OUT=$tmp/run-curve TANDEM_TRAIN_ARGS="$train_args --steps 1" \
        "$task" trainer >"$tmp/curve-trainer.out" 2>&1 || st=$?
    if grep -q -- --curve-server-key < <("$TANDEM_BIN/drafter-trainer/drafter-trainer" train --help 2>&1); then
        check "trainer reaches the CURVE server with the keys" test "$st" -eq 0
    else
        check "trainer without --curve-server-key stops and says why" \
            grep -q "has no --curve-server-key" "$tmp/curve-trainer.out"
        check "  ... with status 1" test "$st" -eq 1
    fi
    export TANDEM_STATE=$tmp/state
else
    echo "skipping the non-loopback CURVE server: no CURVE or no non-loopback IPv4 address"
fi

# ---- wait-servers gives up when the server step dies
st=0
TANDEM_STATE=$tmp/state-dead TANDEM_MODEL=$tmp/nowhere SLURM_PROCID=0 SLURM_LOCALID=3 \
    TANDEM_BIND_ADDR=127.0.0.1 "$task" server &
dead=$!
TANDEM_STATE=$tmp/state-dead "$task" wait-servers 1 "$dead" >"$tmp/wait-dead.out" 2>&1 || st=$?
check "wait-servers fails when the server step ends" test "$st" -eq 1
check "  ... naming the server's log" grep -q "server-0.log" "$tmp/wait-dead.out"

# ---- SIGTERM: every server finishes and exits 0
for p in "${pids[@]}"; do kill -TERM "$p"; done
for i in "${!pids[@]}"; do
    st=0
    wait "${pids[i]}" || st=$?
    check "server $i exits 0 on SIGTERM" test "$st" -eq 0
done
pids=()

if ((fails)); then
    for f in "$tmp"/*.out "$tmp"/state*/logs/*.log; do
        echo "--- $f"
        tail -n 15 "$f"
    done
    exit 1
fi
echo "all slurm task checks passed"
