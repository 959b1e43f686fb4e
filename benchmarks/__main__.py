"""Run the benchmark suite: ``python -m benchmarks [--runs N] [--quick] [--cases W1,W3,...]``.

Writes ``benchmarks/results/results.json`` and ``results.md`` (after every comparison, so an
interrupted run keeps what it measured).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from benchmarks.cases import CASE_KEYS, CASES, SuiteSettings
from benchmarks.report import write_results
from benchmarks.runner import REPO_ROOT, Comparison, run_comparison, summarize_comparison

FRAMEWORKS = ("lightning", "torchtnt", "accelerate")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--runs", type=int, default=5, help="runs per contender (default 5)")
    parser.add_argument(
        "--quick", action="store_true", help="few steps and a small checkpoint: a smoke run"
    )
    parser.add_argument(
        "--cases",
        default=",".join(CASE_KEYS),
        help=f"comma-separated cases to run, in this order (default all: {','.join(CASE_KEYS)})",
    )
    parser.add_argument(
        "--checkpoint-params-millions",
        type=float,
        default=None,
        help="model size of the checkpoint case (default 100: 1.2 GB with AdamW; 2 with --quick)",
    )
    parser.add_argument("--output-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, but is {args.runs} instead.")
    unknown = sorted(set(args.cases.split(",")) - set(CASE_KEYS))
    if unknown:
        parser.error(
            f"--cases must name cases of {', '.join(CASE_KEYS)}, but has {', '.join(unknown)}."
        )
    if args.checkpoint_params_millions is None:
        args.checkpoint_params_millions = 2.0 if args.quick else 100.0
    if args.checkpoint_params_millions <= 0:
        parser.error(
            "--checkpoint-params-millions must be greater than zero, but is "
            f"{args.checkpoint_params_millions} instead."
        )
    return args


def describe_machine() -> dict[str, Any]:
    import torch

    frameworks: dict[str, str] = {}
    for name in FRAMEWORKS:
        try:
            frameworks[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            frameworks[name] = "not installed"
    return {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "frameworks": frameworks,
    }


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def exit_on_sigterm(signum: int, frame: object) -> None:
    # As an exception, so the runner kills the run in flight instead of leaving it orphaned.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    settings = SuiteSettings(
        quick=args.quick, checkpoint_params_millions=args.checkpoint_params_millions
    )
    # In the order given, so the figures needed most can come first.
    selected = args.cases.split(",")
    by_key = {case.KEY: case for case in CASES}
    comparisons: list[Comparison] = [
        comparison for key in selected for comparison in by_key[key].comparisons(settings)
    ]
    shown_argv = sys.argv[1:] if argv is None else argv
    results: dict[str, Any] = {
        "suite": {
            "command": shlex.join(["python", "-m", "benchmarks", *shown_argv]),
            "runs": args.runs,
            "quick": args.quick,
            "cases": selected,
            "started": now(),
            "finished": None,
        },
        "machine": describe_machine(),
        "comparisons": [],
    }
    for comparison in comparisons:
        print(f"{comparison.key}: {comparison.title}", flush=True)
        runs = run_comparison(comparison, runs=args.runs, log=lambda line: print(line, flush=True))
        results["comparisons"].append(summarize_comparison(comparison, runs))
        results["suite"]["finished"] = now()
        json_path, md_path = write_results(results, args.output_dir)
    print(f"Wrote {json_path} and {md_path}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
