#!/usr/bin/env bash
# Rebuilds the seed corpora tests/fuzz/corpus/<target>/ from the fixtures and the real encoders
# (tests/fuzz/make_corpus.c). Usage: tests/fuzz/make_corpus.sh [BUILD_DIR] (default build).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
build="${1:-$root/build}"
cmake --build "$build" --target fuzz_make_corpus -j2 >/dev/null
for t in safetensors st_index cfg proto decode compress shard dataset runcfg; do
    rm -rf "$root/tests/fuzz/corpus/$t"
    mkdir -p "$root/tests/fuzz/corpus/$t"
done
"$build/tests/fuzz_make_corpus" "$root" "$root/tests/fuzz/corpus"
du -sh "$root/tests/fuzz/corpus"/*
