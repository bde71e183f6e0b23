# shellcheck shell=bash disable=SC2154,SC2034 # the launcher's variables, read and set here
# deploy/tandem-balance.sh — sourced by tandem-launch: the split of a node's GPUs between
# target-servers and trainers (--gpus), from the planner's rates, and the check of that split
# against what the run measures (--balance-after). Uses the launcher's variables and functions
# (say, warn, die_usage, alive, trainer_out, the GPU lists, endpoints, paths).

# The planner's rates from `drafter-trainer train --dry-run` on stdin: "rho target_tok_s
# trainer_tok_s fp8_factor gpus_bf16 gpus_fp8" (rho: target GPUs per trainer GPU at bf16; gpus_*:
# the GPUs one replica's weights take at each precision).
plan_rates() {
    awk '
      function num(x,  m) { m = 1; if (x ~ /k$/) m = 1e3; else if (x ~ /M$/) m = 1e6; else if (x ~ /G$/) m = 1e9
                           sub(/[kMG]$/, "", x); return x * m }
      /drafter step time/ { for (i = 1; i <= NF; i++) if ($i == "tok/s") { x = $(i - 1); sub(/^\(/, "", x); tr = num(x) } }
      /one target GPU produces/ { tg = num($5) }
      /at --precision fp8/ { for (i = 1; i <= NF; i++) if ($i == "(x") { f = $(i + 1); sub(/,$/, "", f) } }
      $1 == "target" && $2 == "GPUs" && $3 == "per" && $6 ~ /^[0-9.]+$/ && rho == "" { rho = $6 }
      /H200s that hold them/ { for (i = 1; i <= NF; i++) if ($i == "/" && $(i - 1) ~ /^[0-9]+$/) { gb = $(i - 1); gf = $(i + 1) } }
      END { if (rho == "" || tg == "" || tr == "") exit 1
            print rho, tg, tr, (f == "" ? 1 : f), (gb == "" ? 1 : gb), (gf == "" ? 1 : gf) }'
}

# Trainers t of G GPUs (the others serve, in replicas of K GPUs) making min(t, (G - t) / rho)
# largest; 1 for one GPU; 0 when no t leaves a whole number of replicas.
split_trainers() {
    awk -v G="$1" -v r="$2" -v K="${3:-1}" 'BEGIN { best = (G == 1 && K == 1) ? 1 : 0; bv = -1
        for (t = 1; t < G; t++) { if ((G - t) % K) continue
                                  v = (G - t) / r; if (t < v) v = t; if (v > bv + 1e-9) { bv = v; best = t } }
        print best }'
}

# Whether the servers run FP8: --precision in --server-args, else an FP8 checkpoint's default.
servers_fp8() {
    local i
    for ((i = 0; i < ${#server_extra[@]}; i++)); do
        if [[ ${server_extra[i]} == --precision ]]; then [[ ${server_extra[i + 1]:-} == fp8 ]]; return; fi
        if [[ ${server_extra[i]} == --precision=* ]]; then [[ ${server_extra[i]#*=} == fp8 ]]; return; fi
    done
    [[ -f $model/config.json ]] && grep -Eq '"quant_method"[[:space:]]*:[[:space:]]*"fp8"' "$model/config.json"
}

# --gpus: sets server_gpus, trainer_gpus and split_note from the planner.
split_note=""
auto_split() {
    local dt=${bin_dir:-$(dirname "$HERE")/build}/drafter-trainer/drafter-trainer
    [[ -x $dt ]] || die_usage "--gpus asks the planner, but there is no drafter-trainer at '$dt': build first or give --bin-dir"
    local cmd=("$dt" train --dry-run --target "$model") plan rates
    if [[ -n $run_config ]]; then cmd+=(--run-config "$run_config"); fi
    if [[ -n $drafter_config ]]; then cmd+=(--config "$drafter_config"); fi
    cmd+=("${train_extra[@]}")
    plan=$("${cmd[@]}" 2>&1) || {
        printf '%s\n' "$plan" >&2
        die_usage "--gpus: the planner (drafter-trainer train --dry-run) failed on these configs"
    }
    rates=$(plan_rates <<<"$plan") || die_usage "--gpus: cannot read the planner's rates from its output"
    local rho tg tr f gb gf prec=bf16 G t s g k K
    read -r rho tg tr f gb gf <<<"$rates"
    K=$gb
    if servers_fp8; then
        prec=fp8 K=$gf
        rho=$(awk -v r="$rho" -v f="$f" 'BEGIN { printf "%.3f", r / f }')
        tg=$(awk -v x="$tg" -v f="$f" 'BEGIN { printf "%.0f", x * f }')
    fi
    IFS=, read -r -a g <<<"$gpus"
    G=${#g[@]}
    t=$(split_trainers "$G" "$rho" "$K")
    ((t > 0)) || die_usage "--gpus: one replica of this target takes $K GPUs at $prec, and $G GPU(s) leave no room for a trainer beside whole replicas; give more GPUs (or --server-args \"--precision fp8\")"
    if ((G == 1)); then
        server_gpus=${g[0]} trainer_gpus=${g[0]} s=1
    else
        s=$((G - t)) server_gpus=""
        for ((k = 0; k < s; k++)); do # replicas of K GPUs: 0+1,2+3
            server_gpus+=${g[k]}
            if ((k + 1 < s)); then
                if (((k + 1) % K)); then server_gpus+=+; else server_gpus+=,; fi
            fi
        done
        trainer_gpus=$(IFS=,; printf '%s' "${g[*]:s}")
    fi
    split_note=$(awk -v G="$G" -v s="$s" -v t="$t" -v r="$rho" -v tg="$tg" -v tr="$tr" -v p="$prec" -v K="$K" -v one="$((G == 1))" 'BEGIN {
        printf "auto split of %d GPU(s): %d server(s)%s, %d trainer(s)%s; the planner: one trainer GPU needs %.2f target GPUs at %s " \
               "(%.0f tok/s per target GPU, %.0f per trainer GPU): supply %.0f tok/s against demand %.0f (%.2fx)",
               G, s / K, (K > 1 ? sprintf(" of %d GPUs each", K) : ""), t, one ? " sharing it" : "", r, p, tg, tr, s * tg,
               t * tr, (t * tr > 0 ? s * tg / (t * tr) : 0) }')
}

# The "tokens busy_s" totals of server I from `target-server status`, or nothing; asked up to
# three times (one of four reports on a shared H200 got no answer within the 3 s).
server_totals() {
    local try got
    for try in 1 2 3; do
        got=$("$ts_bin" status --server "${endpoints[$1]}" --json --timeout-ms 3000 2>/dev/null |
            grep -o '"totals":{[^}]*}' |
            awk '{ t = b = ""; n = split($0, kv, ",")
                   for (i = 1; i <= n; i++) { if (kv[i] ~ /"tokens":/) { t = kv[i]; sub(/.*"tokens":/, "", t) }
                                              if (kv[i] ~ /"busy_s":/) { b = kv[i]; sub(/.*"busy_s":/, "", b); sub(/}$/, "", b) } }
                   if (t != "" && b != "") print t, b }') || true
        if [[ -n $got || $try == 3 ]]; then break; fi
    done
    printf '%s' "$got"
}

# Until every trainer's metrics.jsonl has K lines (0), or a trainer ended with fewer (1).
wait_steps() {
    local k=$1 r n f
    while :; do
        n=0
        for ((r = 0; r < world; r++)); do
            f=$(trainer_out "$r")/metrics.jsonl
            if [[ -f $f ]] && (($(wc -l <"$f") >= k)); then
                n=$((n + 1))
            elif ! alive "${trainer_pids[r]}"; then
                return 1
            fi
        done
        ((n == world)) && return 0
        sleep 0.2
    done
}

# --balance-after N, in the background: the window is steps 3 .. N + 2 of every trainer and the
# servers' counters over the same time; the report goes to stdout and logs/balance.txt.
balance_report() {
    local n=$1 i r s0=() s1=() G
    wait_steps 2 || return 0
    for ((i = 0; i < n_servers; i++)); do s0[i]=$(server_totals "$i"); done
    wait_steps $((n + 2)) || return 0
    for ((i = 0; i < n_servers; i++)); do s1[i]=$(server_totals "$i"); done
    local metrics=()
    for ((r = 0; r < world; r++)); do metrics+=("$(trainer_out "$r")/metrics.jsonl"); done
    # GPUs, not servers: a server over a group of GPUs (0+1) counts each of them
    local sg
    sg=$(printf '%s\n' "${sgpu[@]//+/$'\n'}" | wc -l)
    G=$(printf '%s\n' "${sgpu[@]//+/$'\n'}" "${tgpu[@]}" | sort -u | wc -l)
    local shared=$((G < sg + world))
    {
        for ((i = 0; i < n_servers; i++)); do echo "server ${s0[i]:-x x} ${s1[i]:-x x}"; done
        for f in "${metrics[@]}"; do
            sed -n "3,$((n + 2))p" "$f" | awk '{ t = w = c = ""
                if (match($0, /"tokens": [0-9]+/)) t = substr($0, RSTART + 10, RLENGTH - 10)
                if (match($0, /"wait_s": [0-9.eE+-]+/)) w = substr($0, RSTART + 10, RLENGTH - 10)
                if (match($0, /"compute_s": [0-9.eE+-]+/)) c = substr($0, RSTART + 13, RLENGTH - 13)
                print "step", t, w, c }'
        done
    } | awk -v n="$n" -v s="$n_servers" -v t="$world" -v G="$G" -v sg="$sg" -v shared="$shared" '
        $1 == "server" && $2 != "x" && $4 != "x" { dt += $4 - $2; db += $5 - $3 }
        $1 == "step" { tok += $2; w += $3; c += $4 }
        END {
            W = (w + c > 0) ? w / (w + c) : 0; D = (c > 0) ? tok / c : 0; C = (db > 0) ? dt / db : 0
            printf "balance after %d steps per trainer: the trainers waited %.1f%% of their time for hidden states\n", n, 100 * W
            printf "  demand: %d trainer(s) consume %.0f tok/s each when not waiting (%.0f in all)\n", t, D, t * D
            if (C > 0) {
                printf "  supply: %d server(s) make %.0f tok/s each when busy (%.0f in all): supply / demand %.2fx\n", s, C, s * C, s * C / (t * D)
                r = D / C * sg / s
                printf "  target GPUs per trainer GPU, measured: %.2f\n", r
                if (sg > s) {
                    printf "  servers over groups of GPUs (%d GPUs for %d server(s)): no other split of them to suggest\n", sg, s
                } else if (!shared && G > 1) {
                    best = 1; bv = -1
                    for (k = 1; k < G; k++) { v = (G - k) / r; if (k < v) v = k; if (v > bv + 1e-9) { bv = v; best = k } }
                    if (best == t) printf "  the balanced split of these %d GPUs is this one: %d server(s), %d trainer(s)\n", G, s, t
                    else printf "  the balanced split of these %d GPUs: %d server(s), %d trainer(s) (this run: %d, %d); restart with --auto-resume to apply it\n", G, G - best, best, s, t
                } else {
                    printf "  servers and trainers share GPUs here: no other split of them to suggest\n"
                }
            } else {
                printf "  supply: the servers did not report their busy time (an older target-server?)\n"
            }
        }' | while IFS= read -r line; do say "$line"; printf '%s\n' "$line" >>"$logs/balance.txt"; done
}

# finish: a report under way gets a few seconds to end, then goes with the rest.
balance_stop() {
    local k
    [[ -n $watcher ]] || return 0
    for ((k = 0; k < 50; k++)); do alive "$watcher" || break; sleep 0.1; done
    kill "$watcher" 2>/dev/null || true
    wait "$watcher" 2>/dev/null || true
    watcher=""
}
