#!/usr/bin/env bash
# tests/test_deploy_units.sh — the systemd units' ExecStart lines run for real on the CPU with
# the tiny target, the way systemd would run them: continuation lines joined, %i replaced by
# the instance, $$ by $, the command line split like systemd's (shell-like quoting), and the
# environment taken from EnvironmentFile-style KEY=VALUE files. tandem-target-server@1 binds
# TANDEM_BASE_PORT + 1 and writes its endpoint; tandem-drafter-trainer@r1 trains 2 steps on a
# JSONL dataset live from it, and its second start finds the checkpoint and resumes to step 4
# (--resume added by the unit); the server stops cleanly (exit 0) on KillSignal=SIGTERM within
# TimeoutStopSec. Also `systemd-analyze verify` of both units where it is installed.
# Usage: test_deploy_units.sh SOURCE_DIR BINARY_DIR
set -euo pipefail

src=$1 bin=$2
. "$src/tests/deploy_tiny_job.sh" # tiny_job_files
units=$src/deploy/systemd
tmp=$(mktemp -d /tmp/tandem-units-XXXXXX)
fails=0 server=""
check() { # check DESCRIPTION COMMAND...
    local what=$1
    shift
    if "$@"; then echo "ok: $what"; else
        echo "FAILED: $what"
        fails=$((fails + 1))
    fi
}
cleanup() {
    if [[ -n $server ]]; then kill -KILL "$server" 2>/dev/null || true; fi
    wait 2>/dev/null || true
    if ((fails == 0)); then rm -rf "$tmp"; else echo "kept $tmp"; fi
}
trap cleanup EXIT

# exec_start UNIT INSTANCE: the unit's ExecStart as systemd would hand it to execve, into CMD
exec_start() {
    local text line
    text=$(sed -e ':a' -e '/\\$/N; s/\\\n/ /; ta' "$1" | grep '^ExecStart=')
    line=${text#ExecStart=}
    line=${line//%i/$2}
    line=${line//\$\$/\$}
    # systemd's splitting is shell-like for these lines (single quotes, no expansions left)
    eval "CMD=($line)"
}

# run_unit UNIT INSTANCE ENVFILE LOG [&]: the command in a clean environment plus ENVFILE
unit_env() {
    local k v
    ENVV=(PATH=/usr/bin:/bin "RUNTIME_DIRECTORY=$tmp/run-$2" OMP_NUM_THREADS=1)
    while IFS= read -r line; do
        [[ -z $line || $line == \#* ]] && continue
        k=${line%%=*} v=${line#*=}
        ENVV+=("$k=$v")
    done <"$3"
    mkdir -p "$tmp/run-$2"
}

if command -v systemd-analyze >/dev/null; then
    mkdir -p "$tmp/verify"
    cp "$units/tandem-target-server@.service" "$tmp/verify/tandem-target-server@1.service"
    cp "$units/tandem-drafter-trainer@.service" "$tmp/verify/tandem-drafter-trainer@r1.service"
    check "systemd-analyze verify" systemd-analyze verify --man=no \
        "$tmp/verify/tandem-target-server@1.service" "$tmp/verify/tandem-drafter-trainer@r1.service"
fi

# ---- data: a tiny JSONL dataset (counting documents, 3-token prompts) and the drafter config
tiny_job_files "$tmp"

# ---- tandem-target-server@1
port=$((20000 + ($$ * 7) % 30000))
cat >"$tmp/server.env" <<EOF
# as /etc/tandem/target-server.env
TANDEM_BIN=$bin
TANDEM_MODEL=$src/models/tiny-qwen35
TANDEM_BASE_PORT=$((port - 1))
TANDEM_DEVICE=cpu
TANDEM_SERVE_ARGS=--credits 2 --stats-interval 0
EOF
exec_start "$units/tandem-target-server@.service" 1
unit_env x 1 "$tmp/server.env"
env -i "${ENVV[@]}" "${CMD[@]}" >"$tmp/server.log" 2>&1 &
server=$!
for _ in $(seq 600); do
    if grep -q "answering requests" "$tmp/server.log" 2>/dev/null || ! kill -0 "$server" 2>/dev/null; then break; fi
    sleep 0.1
done
check "server bound TANDEM_BASE_PORT + instance" grep -qx "tcp://127.0.0.1:$port" "$tmp/run-1/endpoint"
check "server ready" grep -q "answering requests" "$tmp/server.log"
if ((fails > 0)); then # no server: the trainer steps would only wait out their timeout
    echo "the server's log:"
    cat "$tmp/server.log"
    exit 1
fi

# ---- tandem-drafter-trainer@r1, started twice
cat >"$tmp/r1.env" <<EOF
# as /etc/tandem/runs/r1.env
TANDEM_BIN=$bin
TANDEM_RUNS_DIR=$tmp/runs
TANDEM_MODEL=$src/models/tiny-qwen35
TANDEM_DRAFTER_CONFIG=$tmp/drafter.json
TANDEM_SERVER=tcp://127.0.0.1:$port
TANDEM_DEVICE=cpu
TANDEM_TRAIN_ARGS=--dataset $tmp/data.jsonl --token-budget 128 --max-anchors 16 --seed 3 --steps 2 --timeout-ms 60000
EOF
exec_start "$units/tandem-drafter-trainer@.service" r1
unit_env x r1 "$tmp/r1.env"
st=0
env -i "${ENVV[@]}" "${CMD[@]}" >"$tmp/r1-a.log" 2>&1 || st=$?
check "first start trains (exit 0)" test "$st" -eq 0
check "first start: 2 steps" test "$(wc -l <"$tmp/runs/r1/metrics.jsonl")" -eq 2
check "first start: a checkpoint" test -f "$tmp/runs/r1/checkpoints/latest"
sed -i 's/--steps 2/--steps 4/' "$tmp/r1.env"
unit_env x r1 "$tmp/r1.env"
st=0
env -i "${ENVV[@]}" "${CMD[@]}" >"$tmp/r1-b.log" 2>&1 || st=$?
check "second start resumes (exit 0)" test "$st" -eq 0
check "second start: resumed at step 2" grep -q "resuming" "$tmp/r1-b.log"
check "second start: 4 steps in all" test "$(wc -l <"$tmp/runs/r1/metrics.jsonl")" -eq 4

# ---- KillSignal=SIGTERM: the server finishes and exits 0 within TimeoutStopSec
stop_s=$(sed -n 's/^TimeoutStopSec=//p' "$units/tandem-target-server@.service")
kill -TERM "$server"
st=0
timeout "$stop_s" tail --pid="$server" -f /dev/null || st=$?
check "server gone within TimeoutStopSec=$stop_s after SIGTERM" test "$st" -eq 0
st=0
wait "$server" || st=$?
server=""
check "server exit status 0 on SIGTERM" test "$st" -eq 0
check "server logged its clean stop" grep -q "served " "$tmp/server.log"

if ((fails)); then
    for f in "$tmp"/*.log; do
        echo "--- $f"
        tail -n 20 "$f"
    done
    exit 1
fi
echo "all unit checks passed"
