"""One process of a step-time comparison: train a workload with one loop, print its figures.

``python -m benchmarks.step_worker --workload mlp --loop trainer [--quick] [--num-prefetch N]``
(under ``torchrun`` for data parallelism). Prints ``BENCH_RESULT {"step_time_s": ...,
"max_rss_bytes": ...}`` on rank 0.
"""

from __future__ import annotations

import argparse

from benchmarks.loops import LOOPS, LoopOptions, run_loop
from benchmarks.probe import emit, exit_now, use_one_thread
from benchmarks.workloads import WORKLOAD_NAMES, make_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=WORKLOAD_NAMES, required=True)
    parser.add_argument("--loop", choices=tuple(LOOPS), required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--num-prefetch", type=int, default=0)
    args = parser.parse_args()
    use_one_thread()
    workload = make_workload(args.workload)
    seconds = run_loop(
        args.loop,
        workload,
        workload.plan(quick=args.quick),
        LoopOptions(num_prefetch=args.num_prefetch),
    )
    emit({"step_time_s": seconds})
    exit_now()


if __name__ == "__main__":
    main()
