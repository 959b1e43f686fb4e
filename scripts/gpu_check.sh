#!/usr/bin/env bash
# The first run on a GPU machine, in one command (docs/gpu.md):
#   scripts/gpu_check.sh OUT_DIR [--dry-run] [--parts char_lm,oom,...]
# Runs with the machine's own python3 and torch, no network: the packages its image lacks come
# from the wheels in WHEELS_DIR (default wheels/, filled beforehand by scripts/gpu_wheels.sh),
# installed into OUT_DIR/site. Writes OUT_DIR/report.md.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: scripts/gpu_check.sh OUT_DIR [--dry-run] [--parts a,b]" >&2; exit 2; }
out_dir=$1
python=${PYTHON:-python3}
wheels=${WHEELS_DIR:-wheels}
site=""
mkdir -p "$out_dir"
if compgen -G "$wheels/*.whl" >/dev/null && ! [[ " $* " == *" --dry-run "* ]]; then
    site="$(cd "$out_dir" && pwd)/site"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$wheels"/*.whl
fi
export PYTHONPATH="$PWD/src:$PWD${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$python" scripts/gpu_check.py "$@"
