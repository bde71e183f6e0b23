#!/usr/bin/env bash
# tests/test_check_floors.sh — the floor check (scripts/check_floors.py) on the real tree, and on
# copies of it with one planted fault each, every one of which it must refuse by name: an include
# from base up to chan, from format up to kernels, from the drafter's model up to its commands,
# one program including the other, a header circle, and a source file left in flat common/.
# Usage: test_check_floors.sh SOURCE_DIR
set -euo pipefail

src=$1
check=$src/scripts/check_floors.py
tmp=$(mktemp -d /tmp/tandem-floors-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fails=0

expect() { # expect NAME RC PATTERN TREE
    local name=$1 rc=$2 pat=$3 tree=$4 out got=0
    out=$(python3 "$check" "$tree" 2>&1) || got=$?
    if [[ $got -eq $rc ]] && grep -q -- "$pat" <<<"$out"; then
        echo "ok: $name"
    else
        echo "FAILED: $name (exit $got, want $rc and '$pat'):"
        echo "$out" | head -20
        fails=$((fails + 1))
    fi
}

fresh() { # a copy of the product folders
    rm -rf "$tmp/t"
    mkdir -p "$tmp/t"
    cp -r "$src/common" "$src/kernels" "$src/target-server" "$src/drafter-trainer" "$tmp/t/"
}
plant() { # plant FILE LINE: the line goes first in FILE
    printf '%s\n' "$2" | cat - "$1" >"$1.new" && mv "$1.new" "$1"
}

expect "the tree itself" 0 "every include goes down the floors" "$src"

fresh
plant "$tmp/t/common/base/cm_status.c" '#include "cm_chan.h"'
expect "base includes chan" 1 'common/base/cm_status.c: includes "cm_chan.h" from common/chan, a higher floor' "$tmp/t"

fresh
plant "$tmp/t/common/format/cm_cfg.c" '#include "kn_backend.h"'
expect "format includes kernels" 1 'common/format/cm_cfg.c: includes "kn_backend.h" from kernels' "$tmp/t"

fresh
ts=$(cd "$tmp/t" && find target-server -maxdepth 1 -name '*.c' | sort | head -1)
dt=$(cd "$tmp/t" && find drafter-trainer -name '*.h' | head -1)
plant "$tmp/t/$ts" "#include \"$(basename "$dt")\""
expect "one program includes the other" 1 "the two programs never include each other" "$tmp/t"

fresh
plant "$tmp/t/drafter-trainer/model/dt_model.c" '#include "dt_train_args.h"'
expect "the drafter model includes a command" 1 'drafter-trainer/model/dt_model.c: includes "dt_train_args.h" from drafter-trainer/cmd, a higher floor' "$tmp/t"

fresh
printf '#include "cm_loop_b.h"\n' >"$tmp/t/common/base/cm_loop_a.h"
printf '#include "cm_loop_a.h"\n' >"$tmp/t/common/base/cm_loop_b.h"
expect "a header circle" 1 "include circle: common/base/cm_loop_a.h -> common/base/cm_loop_b.h -> common/base/cm_loop_a.h" "$tmp/t"

fresh
printf 'int cm_stray;\n' >"$tmp/t/common/cm_stray.c"
expect "a file on no floor" 1 "common/cm_stray.c: in common/ but on no floor" "$tmp/t"

((fails == 0)) && echo "test_check_floors: all passed" || echo "test_check_floors: $fails failed"
exit $((fails > 0))
