#!/usr/bin/env bash
# tests/interop/run_zlab.sh — interoperability with z-lab's `dflash` package (PyPI dflash==0.1.0), on the CPU.
#
# Trains drafters on the embedded tiny target with the built programs, loads each checkpoint in z-lab's package
# and decodes with z-lab's own speculative decoder against the target run by Hugging Face Transformers:
#   1. a virtual environment with the pinned packages of tests/interop/venv.sh (made once, reused while the pins
#      match);
#   2. `target-server serve` of models/tandem-tiny, `drafter-trainer precompute` of the taps of
#      data/tiny/train.jsonl (1024-token packs) into shards, then the server stops;
#   3. from the shards, the quickstart's training (--epochs INTEROP_EPOCHS, --lr 3e-3, --max-anchors 64) of
#      models/tandem-tiny-drafter.json (DFlash) and models/tandem-tiny-drafter2.json (DFlash2), and an untrained
#      drafter of each (one step at --lr 0: Tandem's initialisation, in the serving format);
#   4. Tandem's own τ estimate: `drafter-trainer grad`'s teacher-forced τ over every anchor of
#      data/tiny/valid.jsonl (heldout_tau.py);
#   5. z-lab's loader and decoder on the held-out prompts (zlab_decode.py): fails on a missing or unexpected key,
#      on a decode that is not the target's own greedy output, or when a trained drafter's real τ is not above
#      its untrained one's; prints the table;
#   6. the target's greedy answers to the held-out prompts (`target-server generate`), then per drafter grad's
#      τ_chain on that text against the τ of Tandem's own decoder (`drafter-trainer eval`) on those prompts:
#      fails when they differ by more than 0.02.
# About 3 minutes on 2 cores once the environment exists; making it adds 1-2 minutes (PyPI's torch with its CUDA
# libraries, about 3 GB, where the CPU-only torch index cannot be reached). Knobs:
#   BUILD_DIR               where target-server and drafter-trainer are built (default build)
#   INTEROP_VENV            the virtual environment (default $BUILD_DIR/interop-venv)
#   INTEROP_OUT             the run's files: shards, checkpoints, logs (default $BUILD_DIR/interop-run, emptied)
#   INTEROP_EPOCHS          training epochs (default 12, the quickstart's)
#   INTEROP_MAX_NEW_TOKENS  decode cap per prompt (default 64)
#   INTEROP_PROMPTS         only the first N held-out prompts (default 0: all 100)
#   INTEROP_UNTRAINED_EVERY the untrained drafters decode every K-th prompt (default 4: 25 of 100), compared with
#                           the trained one on those same prompts
#   INTEROP_UNFIXED=1       also decode with z-lab's loop unpatched and report its lossless count
set -euo pipefail
cd "$(dirname "$0")/../.."
t_start=$SECONDS
build=${BUILD_DIR:-build}
ts=$build/target-server/target-server
dt=$build/drafter-trainer/drafter-trainer
venv=${INTEROP_VENV:-$build/interop-venv}
out=${INTEROP_OUT:-$build/interop-run}
epochs=${INTEROP_EPOCHS:-12}
max_new=${INTEROP_MAX_NEW_TOKENS:-64}
n_prompts=${INTEROP_PROMPTS:-0}
say() { echo "interop: $*"; }
die() { echo "interop: FAIL: $*" >&2; exit 1; }
for b in "$ts" "$dt"; do [ -x "$b" ] || die "$b is not built (bash scripts/build.sh, or set BUILD_DIR)"; done

# ---- 1. the environment (tests/interop/venv.sh: the pins, made once and reused)
py=$venv/bin/python
bash tests/interop/venv.sh "$venv" || die "the Python environment $venv could not be made"

# ---- 2. shards of the training split's taps, from a live server
rm -rf "$out"
mkdir -p "$out"
export OMP_NUM_THREADS=1 # the tiny model gains nothing from threads; the machine has two cores
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1
cfg1=models/tandem-tiny-drafter.json
cfg2=models/tandem-tiny-drafter2.json
taps=$("$py" -c "import json,sys; t=[json.load(open(f))['dflash_config']['target_layer_ids'] for f in sys.argv[1:]]; assert all(x==t[0] for x in t), 'the two configs tap different layers'; print(','.join(map(str,t[0])))" $cfg1 $cfg2)
endpoint="ipc://$out/target.ipc"
"$ts" serve --model models/tandem-tiny --bind "$endpoint" --log-level warn &
server=$!
bg=("$server") # what an early exit stops
trap 'kill "${bg[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
t0=$SECONDS
"$dt" precompute --server "$endpoint" --dataset data/tiny/train.jsonl --token-budget 1024 --layers "$taps" \
    --out "$out/shards" --log-level warn || die "precompute failed"
kill "$server"
wait "$server" 2>/dev/null || true
say "shards of data/tiny/train.jsonl (layers $taps) in $((SECONDS - t0)) s"

# ---- 3. training: DFlash and DFlash2 side by side (one core each), then the one-step untrained drafters
train() { # NAME CONFIG EXTRA... ; the log in $out/NAME.log (exec: a background run's pid is the trainer's)
    local name=$1 config=$2
    shift 2
    exec "$dt" train --config "$config" --target models/tandem-tiny --dataset data/tiny/train.jsonl \
        --token-budget 1024 --shards "$out/shards" --out "$out/$name" --max-anchors 64 --progress off \
        --no-tensorboard --log-level warn "$@" >"$out/$name.log" 2>&1
}
ckpt() { echo "$out/$1/checkpoints/$(cat "$out/$1/checkpoints/latest")"; }
t0=$SECONDS
(train dflash2 $cfg2 --epochs "$epochs" --lr 3e-3) &
d2=$!
bg+=("$d2")
(train dflash $cfg1 --epochs "$epochs" --lr 3e-3) || { tail -n 20 "$out/dflash.log" >&2; die "training DFlash failed"; }
wait $d2 || { tail -n 20 "$out/dflash2.log" >&2; die "training DFlash2 failed"; }
(train dflash-untrained $cfg1 --steps 1 --lr 0) || { tail -n 20 "$out/dflash-untrained.log" >&2; die "the untrained DFlash run failed"; }
(train dflash2-untrained $cfg2 --steps 1 --lr 0) ||
    { tail -n 20 "$out/dflash2-untrained.log" >&2; die "the untrained DFlash2 run failed"; }
cases=(--case DFlash "$(ckpt dflash)" "$(ckpt dflash-untrained)" --case DFlash2 "$(ckpt dflash2)" "$(ckpt dflash2-untrained)")
say "trained in $((SECONDS - t0)) s: $epochs epochs of 18 packs, lr 3e-3, 64 anchors a pack, from shards"
notes=(--table-note "drafters: $cfg1 and $cfg2 (the same sizes; the DFlash2 one with non-causal sliding-64 layers, the convolutions and the selector, α 1, inject); trained $epochs epochs on data/tiny/train.jsonl (1024-token packs, lr 3e-3, 64 anchors), untrained = one step at lr 0 (Tandem's initialisation)")

# ---- 4. Tandem's estimate on the held-out split
ckpts=()
for ((i = 2; i < ${#cases[@]}; i += 4)); do ckpts+=("${cases[i]}" "${cases[i + 1]}"); done
"$py" tests/interop/heldout_tau.py --target-server "$ts" --drafter-trainer "$dt" --target models/tandem-tiny \
    --valid data/tiny/valid.jsonl --work "$out/heldout" --json "$out/heldout-tau.json" "${ckpts[@]}" ||
    die "Tandem's held-out τ could not be measured"

# ---- 5. z-lab's loader and decoder
extra=()
[ "${INTEROP_UNFIXED:-0}" = 1 ] && extra+=(--unfixed)
"$py" tests/interop/zlab_decode.py --target models/tandem-tiny --valid data/tiny/valid.jsonl \
    --max-new-tokens "$max_new" --prompts "$n_prompts" --untrained-every "${INTEROP_UNTRAINED_EVERY:-4}" --tandem-tau "$out/heldout-tau.json" "${cases[@]}" \
    "${notes[@]}" "${extra[@]}" || die "z-lab interoperability (above)"
# ---- 6. τ_chain against Tandem's own decoder: on the target's greedy answers to the held-out prompts
# (`target-server generate`), grad's chain walk over teacher-forced acceptances must give the τ that
# `drafter-trainer eval` measures decoding those prompts, for every drafter
limit=()
[ "$n_prompts" != 0 ] && limit=(--limit "$n_prompts")
"$ts" generate --model models/tandem-tiny --data data/tiny/valid.jsonl --out "$out/regen.jsonl" \
    --max-new "$max_new" "${limit[@]}" --log-level warn 2>"$out/generate.log" || die "generate failed"
"$py" tests/interop/heldout_tau.py --target-server "$ts" --drafter-trainer "$dt" --target models/tandem-tiny \
    --valid "$out/regen.jsonl" --work "$out/regen-heldout" --json "$out/regen-tau.json" "${ckpts[@]}" ||
    die "τ_chain on the regenerated text could not be measured"
endpoint="ipc://$out/decode.ipc"
"$ts" serve --model models/tandem-tiny --bind "$endpoint" --log-level warn 2>"$out/serve-decode.log" &
server=$!
bg+=("$server")
for i in $(seq 1 100); do [ -S "$out/decode.ipc" ] && break; sleep 0.1; done
for i in "${!ckpts[@]}"; do
    "$dt" eval --checkpoint "${ckpts[i]}" --target models/tandem-tiny --server "$endpoint" --data "$out/regen.jsonl" \
        --max-new "$max_new" --batch 8 --json "$out/regen-eval-$i.json" --log-level warn >"$out/regen-eval-$i.log" 2>&1 ||
        { tail -n 5 "$out/regen-eval-$i.log" >&2; die "eval of ${ckpts[i]} failed"; }
done
kill "$server"
wait "$server" 2>/dev/null || true
"$py" - "$out" "${ckpts[@]}" <<'PY' || die "τ_chain does not predict the decoder's τ (above)"
import json, sys
out, ckpts = sys.argv[1], sys.argv[2:]
chain = json.load(open(f"{out}/regen-tau.json"))["drafters"]
bad = 0
for i, c in enumerate(ckpts):
    ev = json.load(open(f"{out}/regen-eval-{i}.json"))
    real, tf, tc = ev["overall"]["tau"], chain[c]["tau"], chain[c]["tau_chain"]
    ok = abs(real - tc) <= 0.02
    bad += not ok
    print(f"interop: {'ok' if ok else 'FAIL'} {c}: on the target's greedy text, real τ {real:.4f} "
          f"({ev['overall']['generated']} tokens, {ev['overall']['steps']} steps), τ_chain {tc:.4f} "
          f"({chain[c]['chain_tokens']} tokens, {chain[c]['chain_steps']} steps), teacher-forced τ {tf:.4f}")
sys.exit(1 if bad else 0)
PY
say "passed in $((SECONDS - t_start)) s (files in $out)"
