#!/usr/bin/env bash
# Installs the Debian packages Tandem builds against, where they are missing.
set -euo pipefail
# python3-venv: tests/interop makes a virtual environment for z-lab's dflash package (pip from PyPI)
pkgs="build-essential cmake pkg-config libzmq3-dev libzstd-dev libcjson-dev libopenblas-dev clang python3 python3-venv"
missing=""
for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
    sudo_=""; [ "$(id -u)" = 0 ] || sudo_="sudo"
    $sudo_ apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq $missing
fi
# A private Slurm for tests/test_deploy_slurm_real.sh (it starts munged, slurmctld and slurmd
# itself; the packages' own services stay off): without recommends, which pull in every plugin.
slurm="munge slurmctld slurmd slurm-client iproute2"
missing=""
for p in $slurm; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
    sudo_=""; [ "$(id -u)" = 0 ] || sudo_="sudo"
    $sudo_ apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq --no-install-recommends $missing
fi
# libFuzzer's runtime (tests/fuzz) is in compiler-rt's package, named after clang's major version.
rt="libclang-rt-$(clang -dumpversion | cut -d. -f1)-dev"
if ! dpkg -s "$rt" >/dev/null 2>&1; then
    sudo_=""; [ "$(id -u)" = 0 ] || sudo_="sudo"
    DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq "$rt"
fi
