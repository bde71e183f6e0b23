#!/usr/bin/env bash
# tests/test_deploy_slurm_real.sh — deploy/slurm/tandem.sbatch submitted with `sbatch --wait` to a
# real Slurm (Debian's slurmctld and slurmd) that the test starts on this machine, with its own
# munged: the CPU job of test_deploy_launch (the tiny target, a tiny drafter, token lists) as one
# heterogeneous job of two server tasks and two trainer ranks. Slurm 22.05 never starts a
# heterogeneous job whose components would share a node, so this host is two Slurm nodes, one
# slurmd each (slurmd -N): the server node and the trainer node, as in production. Checked: the
# job's status 0, keys made, two servers on the node's address (with CURVE keys) and ready, rank r
# on both servers (server r mod 2 first) with its steps, checkpoint and log, the servers stopped cleanly after the
# trainers, and Slurm's record of both components COMPLETED 0:0. Everything (munge key and
# socket, slurm.conf, state, spool, logs, ports chosen free) is private to a temporary directory:
# the system's munge and Slurm, and other runs of this test, are never touched. Exits 77 when
# Slurm cannot run here at all (not root, daemons missing). Usage: SOURCE_DIR BINARY_DIR
set -euo pipefail

src=$1
. "$src/tests/deploy_tiny_job.sh" # tiny_job_files
export TANDEM_BIN=$2

skip() {
    echo "skipping the real Slurm job: $*"
    exit 77
}
# slurmd starts every task as the job's user and slurmctld/slurmd run as SlurmUser: as another
# user than root this would need the system's Slurm accounts and setuid plumbing
((EUID == 0)) || skip "not root (slurmd must run as root to start the tasks)"
for c in munged slurmctld slurmd sbatch sinfo squeue scontrol scancel srun ss; do
    command -v "$c" >/dev/null ||
        skip "no $c (Debian: apt-get install munge slurmctld slurmd slurm-client iproute2; .ci/deps.sh does)"
done

tmp=$(mktemp -d /tmp/tandem-slurm-real-XXXXXX)
# munged refuses a socket in a directory that not everybody can search (clients of any user must
# reach it); mktemp makes it 0700
chmod 755 "$tmp"
export SLURM_CONF=$tmp/slurm/slurm.conf
fails=0 daemons=() munge_pid="" job=""
check() {
    local what=$1
    shift
    if "$@"; then echo "ok: $what"; else
        echo "FAILED: $what"
        fails=$((fails + 1))
    fi
}

# ---- daemons: each in its own process group (setsid), stopped group by group

# waits up to $1 s for the command in "${@:2}" to succeed; no fixed sleeps a slow machine outruns.
# Every wait also ends at `limit`, so that the whole test, cleanup included, stays within ctest's
# TIMEOUT (420 s): a test killed by ctest would leave its daemons running.
limit=$((SECONDS + 300))
wait_for() {
    local deadline=$((SECONDS + $1))
    ((deadline <= limit)) || deadline=$limit
    shift
    until "$@"; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
}
gone() { ! kill -0 "$1" 2>/dev/null; }
stop_group() { # SIGTERM the process group, SIGKILL what is left after 30 s
    kill -TERM -- "-$1" 2>/dev/null || return 0
    wait_for 30 gone "$1" || kill -KILL -- "-$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
}
# Slurm's job processes (slurmstepd and the tasks) leave slurmd's process group; whatever is left
# of them carries this test's SLURM_CONF in its environment, which no other process does
ours_left() {
    local e p
    for e in /proc/[0-9]*/environ; do
        p=${e#/proc/}
        p=${p%/environ}
        ((p != $$ && p != ${munge_pid:-0})) && tr '\0' '\n' 2>/dev/null <"$e" | grep -qxF "SLURM_CONF=$SLURM_CONF" && echo "$p"
    done
    return 0
}
queue_empty() { [[ -z $(squeue -h 2>/dev/null) ]]; }
stop_slurm() { # the job, the daemons (last started first), what is left of the job
    local i p
    if [[ -n $job ]]; then
        scancel "$job" 2>/dev/null || true
        wait_for 60 queue_empty || true
    fi
    for ((i = ${#daemons[@]} - 1; i >= 0; i--)); do stop_group "${daemons[i]}"; done
    daemons=()
    for p in $(ours_left); do kill -KILL "$p" 2>/dev/null || true; done
}
cleanup() {
    limit=$((SECONDS + 100))
    stop_slurm
    if [[ -n $munge_pid ]]; then stop_group "$munge_pid"; fi
    if ((fails == 0)); then rm -rf "$tmp"; else echo "kept $tmp"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

start() { # start NAME COMMAND...: in the background, own process group, output in $tmp/NAME.out
    local name=$1
    shift
    setsid "$@" >"$tmp/$name.out" 2>&1 </dev/null &
    daemons+=("$!")
}

# ---- munge: a private key and daemon (socket, pid, seed and log files in $tmp)
mkdir -p "$tmp/munge" "$tmp/slurm"
chmod 700 "$tmp/slurm"
(umask 077 && head -c 1024 /dev/urandom >"$tmp/munge/munge.key")
munge_sock=$tmp/munge/munge.sock
setsid munged -F --socket="$munge_sock" --key-file="$tmp/munge/munge.key" \
    --pid-file="$tmp/munge/munged.pid" --seed-file="$tmp/munge/munged.seed" --log-file="$tmp/munge/munged.log" \
    >"$tmp/munged.out" 2>&1 </dev/null &
munge_pid=$!
wait_for 30 test -S "$munge_sock" || {
    fails=$((fails + 1))
    echo "FAILED: munged did not start: $(tail -n 5 "$tmp/munged.out")"
    exit 1
}

# ---- Slurm: a controller and two nodes (two slurmd on this host, -N names each)
host=$(hostname -s)
# Ports: a block of five unused TCP ports (controller, two slurmd, two servers), from a range below
# the kernel's ephemeral ports and away from test_deploy_slurm's (20000 + ...); a collision with
# a port taken between the check and the bind shows as a daemon that does not start, and then
# the cluster is started again on other ports.
pick_ports() {
    local used p i ok
    used=" $(ss -Htan | awk '{ n = split($4, a, ":"); printf "%s ", a[n] }') "
    for _ in $(seq 1 50); do
        p=$((10000 + (RANDOM * 32768 + RANDOM + $$ * 7919) % 9990))
        ok=1
        for ((i = p; i < p + 5; i++)); do [[ $used == *" $i "* ]] && ok=0; done
        if ((ok)); then
            echo "$p"
            return
        fi
    done
    echo "$p"
}
# CPUs: each node is given nproc CPUs but at least 2 (two tasks of one CPU), so a 1-core machine
# runs it too; config_overrides keeps slurmd from draining a node whose configured CPUs or
# layout differ from the hardware's (both nodes claim this host's CPUs)
cpus=$(nproc)
((cpus >= 2)) || cpus=2
write_conf() { # write_conf FIRST_PORT
    local p=$1 s=$tmp/slurm
    cat >"$SLURM_CONF" <<EOF
# written by tests/test_deploy_slurm_real.sh: a private one-host cluster
ClusterName=tandemtest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$p
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$munge_sock
StateSaveLocation=$s/state
SlurmdSpoolDir=$s/spool-%n
SlurmctldPidFile=$s/slurmctld.pid
SlurmdPidFile=$s/slurmd-%n.pid
SlurmctldLogFile=$s/slurmctld.log
SlurmdLogFile=$s/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
# heterogeneous jobs are started by the backfill scheduler only: every second, not every 30
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
NodeName=tandem0 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((p + 1)) CPUs=$cpus RealMemory=500
NodeName=tandem1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((p + 2)) CPUs=$cpus RealMemory=500
PartitionName=tandem Nodes=tandem0,tandem1 Default=YES MaxTime=INFINITE State=UP
EOF
}
nodes_idle() { [[ $(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | tr '\n' ' ') == "tandem0 idle tandem1 idle " ]]; }
up=0
for attempt in 1 2 3; do
    port=$(pick_ports)
    write_conf "$port"
    rm -rf "$tmp/slurm/state" "$tmp/slurm"/spool-*
    mkdir -p "$tmp/slurm/state" "$tmp/slurm/spool-tandem0" "$tmp/slurm/spool-tandem1"
    start slurmctld slurmctld -D -i
    start slurmd-tandem0 slurmd -D -N tandem0
    start slurmd-tandem1 slurmd -D -N tandem1
    if wait_for 90 nodes_idle; then
        up=1
        break
    fi
    echo "attempt $attempt: the nodes are not idle after 90 s (ports $port-$((port + 4))):"
    sinfo -N 2>&1 || true
    tail -n 5 "$tmp"/slurm*.out || true
    stop_slurm
done
if ((!up)); then
    fails=$((fails + 1))
    echo "FAILED: no Slurm cluster after 3 attempts"
    exit 1
fi
echo "slurm up: controller on port $port, nodes tandem0 and tandem1 idle ($cpus CPUs each)"

# ---- the job's settings: the deploy tests' tiny drafter and token lists (tiny_job_files), on the CPU
# (an enclosing Slurm job's or the caller's SLURM_*, SBATCH_* and SRUN_* variables would be read
# by sbatch and srun as options: only SLURM_CONF stays)
for v in $(compgen -e); do
    if [[ $v == SLURM_* && $v != SLURM_CONF || $v == SBATCH_* || $v == SRUN_* || $v == SALLOC_* ]]; then unset "$v"; fi
done
unset CUDA_VISIBLE_DEVICES TANDEM_STATE TANDEM_BIND_ADDR
tiny_job_files "$tmp"
export OMP_NUM_THREADS=1 TANDEM_DEVICE=cpu TANDEM_MODEL=$src/models/tiny-qwen35
export TANDEM_OUT=$tmp/run TANDEM_KEYS=$tmp/keys TANDEM_READY_TIMEOUT=120
export TANDEM_DRAFTER_CONFIG=$tmp/drafter.json TANDEM_SERVE_ARGS="--stats-interval 0"
export TANDEM_BASE_PORT=$((port + 3)) TANDEM_SERVER_GPUS_PER_NODE=2 TANDEM_TRAINER_GPUS_PER_NODE=2
export TANDEM_TRAIN_ARGS="--dataset $tmp/data.jsonl --token-budget 128 --max-anchors 16 --seed 3 --timeout-ms 60000 --steps 3"
# the servers bind the node's address with CURVE keys, as on a cluster; without one, loopback
addr=""
for a in $(hostname -I 2>/dev/null); do
    if [[ $a =~ ^[0-9.]+$ && $a != 127.* ]]; then
        addr=$a
        break
    fi
done
if [[ -z $addr ]]; then
    echo "no non-loopback IPv4 address: the servers bind 127.0.0.1 (no CURVE)"
    addr=127.0.0.1
    export TANDEM_BIND_ADDR=$addr
fi

# ---- the job: the script as it is, the GPU and task counts overridden per component (a CPU
# node has no GPUs; two tasks of one CPU each), the output in $tmp; submitted from the
# repository root, which tandem.sbatch takes as SLURM_SUBMIT_DIR to find tandem-task
comp=(--gpus-per-node=0 --ntasks-per-node=2 --cpus-per-task=1 --time=15)
(cd "$src" && exec sbatch --wait --output="$tmp/job-%j.out" "${comp[@]}" : "${comp[@]}" \
    deploy/slurm/tandem.sbatch) >"$tmp/sbatch.out" 2>&1 &
sb=$!
t0=$SECONDS
wait_for 60 grep -q "Submitted batch job" "$tmp/sbatch.out" || true
job=$(awk '/Submitted batch job/ { print $4 }' "$tmp/sbatch.out")
check "sbatch accepts the job with the overrides" test -n "$job"
st=0
if wait_for 240 gone "$sb"; then wait "$sb" || st=$?; else
    echo "the job is not done after 240 s:"
    squeue 2>&1 || true
    kill "$sb" 2>/dev/null || true
    st=124
fi
echo "job $job: sbatch --wait returned $st after $((SECONDS - t0)) s"
out=$tmp/job-$job.out
state=$TANDEM_OUT/slurm-$job.0
check "the job's status is 0" test "$st" -eq 0
check "the job ran servers on tandem0 and trainers on tandem1" \
    grep -q "servers on tandem0, trainers on tandem1" "$out"
check "keys made in TANDEM_KEYS" test -s "$TANDEM_KEYS/server.key" -a -s "$TANDEM_KEYS/clients/trainer.pub"
for i in 0 1; do
    check "server $i bound $addr:$((TANDEM_BASE_PORT + i)) and was ready" \
        grep -qx "tcp://$addr:$((TANDEM_BASE_PORT + i))" "$state/endpoints/server-$i"
    check "  ... wait-servers saw it" grep -q "server $i ready at tcp://$addr:$((TANDEM_BASE_PORT + i))" "$out"
done
for r in 0 1; do
    check "trainer rank $r of 2 on both servers, server $r first" \
        grep -q "rank $r of 2, servers tcp://$addr:$((TANDEM_BASE_PORT + r)),tcp://$addr:$((TANDEM_BASE_PORT + 1 - r))," \
        "$state/logs/trainer-$r.log"
    check "trainer rank $r: 3 steps in rank-$r/" test "$(wc -l <"$TANDEM_OUT/rank-$r/metrics.jsonl" 2>/dev/null)" = 3
    check "trainer rank $r: a checkpoint" test -s "$TANDEM_OUT/rank-$r/checkpoints/latest"
done
check "the trainers ended with status 0, then the servers were stopped" \
    grep -q "trainers ended with status 0; stopping the servers" "$out"
check "no task failed (srun reports none)" bash -c "! grep -q 'srun: error' '$out'"
for i in 0 1; do
    check "server $i stopped cleanly" grep -q "stopped serving" "$state/logs/server-$i.log"
done
# (no slurmdbd, so no sacct: slurmctld keeps the finished job's record for MinJobAge, 300 s)
rec=$(scontrol show job "$job" 2>/dev/null || true)
check "Slurm's record: both components COMPLETED with 0:0" \
    test "$(grep -o 'JobState=COMPLETED' <<<"$rec" | wc -l) $(grep -o 'ExitCode=0:0' <<<"$rec" | wc -l)" = "2 2"
job_left() { # the processes of job $1 still running (the tasks carry its TANDEM_STATE)
    local e
    for e in /proc/[0-9]*/environ; do
        if tr '\0' '\n' 2>/dev/null <"$e" | grep -qxF "TANDEM_STATE=$TANDEM_OUT/slurm-$1.0"; then
            e=${e#/proc/}
            echo "${e%/environ}"
        fi
    done
}
left=$(job_left "$job")
check "no process of the job left${left:+ (pids $left)}" test -z "$left"

# ---- the time limit: Slurm signals the batch shell (--signal=B:TERM@300; here scancel does, as
# at the limit), which stops the trainers with SIGTERM (each saves a checkpoint and exits), then
# the servers; the job ends with 143
export TANDEM_OUT=$tmp/run-stopped TANDEM_TRAIN_ARGS="${TANDEM_TRAIN_ARGS/--steps 3/} --epochs 100000"
(cd "$src" && exec sbatch --wait --output="$tmp/job-%j.out" "${comp[@]}" : "${comp[@]}" \
    deploy/slurm/tandem.sbatch) >"$tmp/sbatch2.out" 2>&1 &
sb=$!
wait_for 60 grep -q "Submitted batch job" "$tmp/sbatch2.out" || true
job=$(awk '/Submitted batch job/ { print $4 }' "$tmp/sbatch2.out")
state=$TANDEM_OUT/slurm-$job.0
trained() { [[ $(wc -l <"$TANDEM_OUT/rank-$1/metrics.jsonl" 2>/dev/null) -ge 5 ]]; }
check "job $job: both ranks train on (5 more steps each)" wait_for 120 eval 'trained 0 && trained 1'
check "scancel --batch --signal=TERM" scancel --batch --signal=TERM "$job"
st=0
if wait_for 120 gone "$sb"; then wait "$sb" || st=$?; else
    echo "the job is not done 120 s after SIGTERM:"
    squeue -s 2>&1 || true
    st=124
fi
out=$tmp/job-$job.out
check "the stopped job's status is 143" test "$st" -eq 143
check "  ... the batch script stopped on the signal" grep -q "stopping on a signal" "$out"
# (srun reports the tasks that a signal ended: SIGTERM, not the SIGKILL of `kill -TERM <srun>`)
check "the trainers were ended by SIGTERM" grep -q "tandem1: tasks 0-1: Terminated" "$out"
check "  ... and no task was killed" bash -c "! grep -q 'Killed' '$out'"
for i in 0 1; do
    check "server $i stopped cleanly after the trainers" grep -q "stopped serving" "$state/logs/server-$i.log"
done
left=$(job_left "$job")
check "no process of the job left${left:+ (pids $left)}" test -z "$left"

if ((fails)); then
    for f in "$tmp"/sbatch.out "$out" "$state"/logs/*.log "$tmp"/slurm/slurmctld.log "$tmp"/slurm/slurmd-*.log; do
        echo "--- $f"
        tail -n 20 "$f" 2>/dev/null || true
    done
    exit 1
fi
echo "all real slurm checks passed"
