#!/usr/bin/env bash
# Runs the multi-process tests (or the pytest selection given after the count) N times in a row
# and counts the runs in which a process aborted at exit ("terminate called without an active
# exception", exit -6) and the runs that failed otherwise.
#   scripts/soak_distributed.sh 20
#   scripts/soak_distributed.sh 20 tests/runtime/training/test_evaluation.py -k torchrun
set -uo pipefail
runs=${1:-20}
shift || true
selection=("$@")
[ ${#selection[@]} -gt 0 ] || selection=(-m "distributed and not slow")
python=${PYTHON:-.venv/bin/python}
log_dir=$(mktemp -d)
aborts=0 failures=0
for i in $(seq "$runs"); do
    log="$log_dir/run_$i.log"
    if "$python" -m pytest -q -p no:cacheprovider "${selection[@]}" >"$log" 2>&1; then
        verdict=passed
    else
        verdict=failed
        failures=$((failures + 1))
    fi
    if grep -qE "terminate called without an active exception|exitcode *: -6|exit -6" "$log"; then
        verdict="$verdict, aborted at exit"
        aborts=$((aborts + 1))
    fi
    echo "run $i/$runs: $verdict ($(tail -n 1 "$log"))"
done
echo "$aborts of $runs runs had an abort at exit; $failures of $runs failed. Logs: $log_dir"
[ "$aborts" -eq 0 ] && [ "$failures" -eq 0 ]
