#!/usr/bin/env bash
# tests/oracle/make_decode_drafters.sh — the decoding fixtures, from scratch: trains the two drafters of
# tests/fixtures/decode/ with the built programs and runs the decoding oracle (make_decode_fixtures.py) on them.
#
#   1. the Python environment of tests/interop/venv.sh (made once, reused);
#   2. as tests/interop/run_zlab.sh does: `target-server serve` of models/tandem-tiny, `drafter-trainer
#      precompute` of the taps of data/tiny/train.jsonl (1024-token packs) into shards, then
#      `drafter-trainer train` from the shards (--lr 3e-3, --max-anchors 64, DECODE_EPOCHS epochs, seed 0) of
#      models/tandem-tiny-drafter.json (DFlash) and models/tandem-tiny-drafter2.json (DFlash2), side by side;
#   3. each final checkpoint's serving files (config.json, model.safetensors, model.safetensors.index.json; not
#      the optimizer state or its checksums) copied to tests/fixtures/decode/dflash/ and dflash2/;
#   4. make_decode_fixtures.py on both: tests/fixtures/decode/dflash.json and dflash2.json, with the training
#      command lines recorded in them.
# About 5 minutes on 2 cores once the environment exists. Knobs:
#   BUILD_DIR        where target-server and drafter-trainer are built (default build)
#   INTEROP_VENV     the virtual environment (default $BUILD_DIR/interop-venv)
#   DECODE_WORK      shards, runs and logs (default $BUILD_DIR/decode-drafters, emptied)
#   DECODE_EPOCHS    training epochs (default 24: twice run_zlab.sh's 12, for a real τ near 1.8 and 2.2)
#   DECODE_PROMPTS   prompts per fixture (default 24); DECODE_MAX_NEW_TOKENS (default 48)
#   DECODE_ONLY=1    skip 1-3's training: only remake the two JSON fixtures from the committed checkpoints
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${BUILD_DIR:-build}
ts=$build/target-server/target-server
dt=$build/drafter-trainer/drafter-trainer
venv=${INTEROP_VENV:-$build/interop-venv}
work=${DECODE_WORK:-$build/decode-drafters}
epochs=${DECODE_EPOCHS:-24}
fixtures=tests/fixtures/decode
say() { echo "decode-drafters: $*"; }
die() { echo "decode-drafters: FAIL: $*" >&2; exit 1; }
py=$venv/bin/python
bash tests/interop/venv.sh "$venv" || die "the Python environment $venv could not be made"
env_=(OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1)
export "${env_[@]}"
cmds=("export ${env_[*]}")
if [ "${DECODE_ONLY:-0}" != 1 ]; then
    for b in "$ts" "$dt"; do [ -x "$b" ] || die "$b is not built (bash scripts/build.sh, or set BUILD_DIR)"; done
    rm -rf "$work"
    mkdir -p "$work" "$fixtures"
    cfg1=models/tandem-tiny-drafter.json
    cfg2=models/tandem-tiny-drafter2.json
    taps=$("$py" -c "import json,sys; t=[json.load(open(f))['dflash_config']['target_layer_ids'] for f in sys.argv[1:]]; assert all(x==t[0] for x in t), 'the two configs tap different layers'; print(','.join(map(str,t[0])))" $cfg1 $cfg2)
    endpoint="ipc://$work/target.ipc"
    serve=("$ts" serve --model models/tandem-tiny --bind "$endpoint" --log-level warn)
    precompute=("$dt" precompute --server "$endpoint" --dataset data/tiny/train.jsonl --token-budget 1024
        --layers "$taps" --out "$work/shards" --log-level warn)
    "${serve[@]}" &
    server=$!
    bg=("$server")
    trap 'kill "${bg[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
    "${precompute[@]}" || die "precompute failed"
    kill "$server"
    wait "$server" 2>/dev/null || true
    cmds+=("${serve[*]} &" "${precompute[*]}")
    train_cmd() { # NAME CONFIG: the training command line
        echo "$dt train --config $2 --target models/tandem-tiny --dataset data/tiny/train.jsonl --token-budget 1024" \
            "--shards $work/shards --out $work/$1 --max-anchors 64 --progress off --no-tensorboard --log-level warn" \
            "--epochs $epochs --lr 3e-3 --seed 0"
    }
    t0=$SECONDS
    c2=$(train_cmd dflash2 $cfg2)
    c1=$(train_cmd dflash $cfg1)
    ($c2 >"$work/dflash2.log" 2>&1) &
    d2=$!
    bg+=("$d2")
    ($c1 >"$work/dflash.log" 2>&1) || { tail -n 20 "$work/dflash.log" >&2; die "training DFlash failed"; }
    wait "$d2" || { tail -n 20 "$work/dflash2.log" >&2; die "training DFlash2 failed"; }
    say "trained in $((SECONDS - t0)) s: $epochs epochs, lr 3e-3, 64 anchors a pack, from shards"
    cmds+=("$c1" "$c2")
    for name in dflash dflash2; do
        step=$work/$name/checkpoints/$(cat "$work/$name/checkpoints/latest")
        rm -rf "${fixtures:?}/$name"
        mkdir -p "$fixtures/$name"
        cp "$step/config.json" "$step/model.safetensors" "$step/model.safetensors.index.json" "$fixtures/$name/"
        cmds+=("cp $step/{config.json,model.safetensors,model.safetensors.index.json} $fixtures/$name/")
        say "$fixtures/$name: $(du -cb "$fixtures/$name"/* | tail -n 1 | cut -f1) bytes"
    done
fi
if [ "${DECODE_ONLY:-0}" = 1 ]; then # the training's command lines, as the previous fixture recorded them
    [ -f "$fixtures/dflash.json" ] || die "DECODE_ONLY=1 needs $fixtures/dflash.json (its training commands)"
    mapfile -t cmds < <("$py" -c "import json,sys; print('\n'.join(json.load(open(sys.argv[1]))['commands'][:-1]))" "$fixtures/dflash.json")
fi
args=()
for c in "${cmds[@]}"; do args+=(--command "$c"); done
"$py" tests/oracle/make_decode_fixtures.py --prompts "${DECODE_PROMPTS:-24}" \
    --max-new-tokens "${DECODE_MAX_NEW_TOKENS:-48}" "${args[@]}" \
    --case "$fixtures/dflash" "$fixtures/dflash.json" --case "$fixtures/dflash2" "$fixtures/dflash2.json" ||
    die "the decoding oracle failed"
