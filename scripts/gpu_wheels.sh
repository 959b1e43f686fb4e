#!/usr/bin/env bash
# Fills DIR (default wheels/, ignored by git) with the pure-Python wheels a GPU machine's image
# lacks, for scripts/gpu_check.sh to install there without a network. Run it here, with a network:
#   scripts/gpu_wheels.sh [DIR]
# Each is downloaded without its dependencies (--no-deps): the image has torch, numpy and
# typing-extensions; name any other missing one in PACKAGES.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-wheels}
python=${PYTHON:-python3}
PACKAGES=("torcheval==0.0.7")
mkdir -p "$dir"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation py --dest "$dir" "${PACKAGES[@]}"
ls "$dir"
