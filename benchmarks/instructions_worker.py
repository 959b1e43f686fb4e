"""One process of the instruction-count comparison: a loop's CPU instructions per step, counted
by valgrind's callgrind.

``python -m benchmarks.instructions_worker --workload mlp --loop trainer [--quick]``. Prints
``BENCH_RESULT {"instructions_per_step": ...}``.

With Python's hash seed fixed, a count of instructions is the same from run to run, whatever
else the machine does, where a step time on a shared host moves by more than a small runtime
cost. It misses what instructions do not show (cache misses, waits), so it complements the timed
cases rather than replacing them.

The process starts itself again under ``valgrind --tool=callgrind`` with counting off, so that
starting Python and importing torch (a few seconds of instructions) are not counted. Where the
steps after warm-up begin, the child turns counting on and dumps the count at once; where they
end, it dumps again. ``callgrind_control`` does both, from a subprocess, and the work of calling
it is the same in both dumps: the second dump less the first is the steps alone.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.loops import LOOPS, LoopOptions, run_loop
from benchmarks.probe import emit, exit_now, use_one_thread, watch_timed_steps
from benchmarks.workloads import WORKLOAD_NAMES, StepPlan, make_workload

# Counted steps: the count is exact, so a few hundred steps are as good as thousands, and
# callgrind runs the steps about fifty times slower than the machine.
_PLAN = StepPlan(num_steps=230, num_warmup=30)
_QUICK_PLAN = StepPlan(num_steps=40, num_warmup=10)
_TOTALS = re.compile(r"^totals:\s+(\d+)", re.MULTILINE)


def missing_tool() -> str | None:
    """Why this worker cannot run here, or None."""
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (it comes with valgrind)"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=WORKLOAD_NAMES, required=True)
    parser.add_argument("--loop", choices=tuple(LOOPS), required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--counted", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    plan = _QUICK_PLAN if args.quick else _PLAN
    if args.counted:
        _run_counted(args.workload, args.loop, plan)
    else:
        num_counted = plan.num_steps - plan.num_warmup
        emit({"instructions_per_step": _count(sys.argv[1:]) / num_counted}, with_rss=False)
    exit_now()


def _count(worker_args: list[str]) -> int:
    """Run this worker under callgrind; the instructions of its counted steps."""
    with tempfile.TemporaryDirectory(prefix="callgrind-") as directory:
        out = Path(directory) / "callgrind.out"
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}.%p",
            sys.executable,
            "-m",
            "benchmarks.instructions_worker",
            *worker_args,
            "--counted",
        ]
        # A fixed hash seed: dict and set layouts, and so the count, are the same in every run.
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        subprocess.run(command, check=True, stdout=sys.stderr, env=env)
        # The child's two dumps: calibration (".1") and the counted steps (".2").
        calibration, steps = (_totals(out, part) for part in (1, 2))
    return steps - calibration


def _totals(out: Path, part: int) -> int:
    [dump] = out.parent.glob(f"{out.name}.*.{part}")
    match = _TOTALS.search(dump.read_text())
    if match is None:
        raise RuntimeError(f"{dump} has no 'totals:' line; is it a callgrind dump?")
    return int(match.group(1))


def _run_counted(workload_name: str, loop: str, plan: StepPlan) -> None:
    pid = str(os.getpid())

    def control(*options: str) -> None:
        subprocess.run(["callgrind_control", *options, pid], check=True, stdout=sys.stderr)

    def begin() -> None:
        control("--instr=on")
        control("--dump")

    watch_timed_steps(begin=begin, end=lambda: control("--dump"))
    use_one_thread()
    workload = make_workload(workload_name)
    run_loop(loop, workload, plan, LoopOptions())


if __name__ == "__main__":
    main()
