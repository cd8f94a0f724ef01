#!/bin/sh
# Make python$1 with venv/ensurepip and headers available in an image.
# The local Debian base already has it (debootstrap --include); NVIDIA CUDA images
# (Ubuntu) get it from apt, or from the deadsnakes PPA where the release lacks it.
set -eu
v="$1"
if command -v "python$v" >/dev/null 2>&1 \
    && "python$v" -c "import ensurepip, sysconfig, os; assert os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h'))"; then
    echo "python$v is here: $(command -v "python$v")"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update
if ! apt-cache show "python$v-venv" >/dev/null 2>&1; then
    apt-get install -y --no-install-recommends software-properties-common gpg-agent
    add-apt-repository -y ppa:deadsnakes/ppa
    apt-get update
fi
apt-get install -y --no-install-recommends "python$v" "python$v-venv" "python$v-dev" g++
rm -rf /var/lib/apt/lists/*
