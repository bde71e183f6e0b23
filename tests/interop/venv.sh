#!/usr/bin/env bash
# tests/interop/venv.sh — the Python environment of the z-lab interop test and the decoding oracle.
#
#   tests/interop/venv.sh DIR
#
# Makes the virtual environment DIR with the pinned packages below, or reuses it while DIR/.interop-pins holds the
# same pins and it imports torch, transformers and dflash.model; then prints the versions on one line. Used by
# tests/interop/run_zlab.sh and tests/oracle/make_decode_fixtures.py's callers (the fixtures record these pins).
# torch 2.13.0 and transformers 5.15.0 are the versions dflash 0.1.0 pins in its "local" extra; dflash itself goes
# in without its dependencies (tqdm, datasets, requests: its benchmark CLI's, not imported by dflash.model).
# torch comes from the CPU-only index where it can be reached, else from PyPI (CUDA libraries included, about
# 3 GB; runs on the CPU). Exit status 0, or 1 with one message on stderr.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 DIR" >&2; exit 2; }
venv=$1
pins="torch==2.13.0 transformers==5.15.0 huggingface_hub==1.33.0 tokenizers==0.22.2 safetensors==0.8.0 numpy==2.4.6 dflash==0.1.0"
cpu_index=https://download.pytorch.org/whl/cpu
py=$venv/bin/python
say() { echo "venv: $*"; }
die() { echo "venv: FAIL: $*" >&2; exit 1; }
if [ "$(cat "$venv/.interop-pins" 2>/dev/null)" != "$pins" ] || ! "$py" -c "import torch, transformers, dflash.model" 2>/dev/null; then
    say "making the Python environment $venv ($pins)"
    rm -rf "$venv"
    python3 -m venv "$venv" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
    t0=$SECONDS
    pip_=("$py" -m pip install -q --disable-pip-version-check)
    if "$py" -c "import urllib.request as u; u.urlopen('$cpu_index/torch/', timeout=10)" 2>/dev/null; then
        say "torch: the CPU-only build from $cpu_index"
        "${pip_[@]}" --index-url "$cpu_index" torch==2.13.0 || die "installing torch failed"
    else
        say "torch: $cpu_index cannot be reached; PyPI's build (CUDA libraries included, about 3 GB; runs on the CPU)"
        "${pip_[@]}" torch==2.13.0 || die "installing torch failed"
    fi
    "${pip_[@]}" transformers==5.15.0 huggingface_hub==1.33.0 tokenizers==0.22.2 safetensors==0.8.0 numpy==2.4.6 ||
        die "installing transformers and its pins failed"
    "${pip_[@]}" --no-deps dflash==0.1.0 || die "installing dflash failed"
    "$py" -c "import torch, transformers, dflash.model" || die "the environment does not import torch, transformers, dflash"
    echo "$pins" >"$venv/.interop-pins"
    say "environment ready in $((SECONDS - t0)) s"
fi
"$py" -c "import torch, transformers, importlib.metadata as m; print('venv: torch', torch.__version__, '| transformers', transformers.__version__, '| dflash', m.version('dflash'))"
