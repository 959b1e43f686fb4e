"""Process launch, alternation and statistics: the parent side of every comparison.

A contender is one command run in a fresh Python process (or a ``torchrun`` gang of them). The
process measures itself and prints one line ``BENCH_RESULT {json}`` (see :mod:`benchmarks.probe`).
The runs of a comparison alternate between contenders (A B C A B C ...), so a neighbour that slows
the machine for a while slows every contender alike instead of one of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, final

RESULT_PREFIX = "BENCH_RESULT "
REPO_ROOT = Path(__file__).resolve().parents[1]
PROCESS_TIMEOUT_S = 600.0
MAX_FAILED_RUNS = 2

Statistic = Literal["median", "min"]


@final
@dataclass(frozen=True)
class Metric:
    """One figure a contender's process reports, and how the table shows it."""

    key: str
    label: str
    unit: Literal["s", "bytes", "count", "ratio", "fraction", "GB/s"]
    summary: Statistic = "median"
    """The statistic the ratio compares: the median, or the min for figures that noise only raises."""
    ratio: bool = True
    """Whether a ratio to the baseline means anything (not when the figures are already deltas)."""


@final
@dataclass(frozen=True)
class Contender:
    name: str
    module: str
    args: tuple[str, ...] = ()
    nproc: int = 1
    """More than one runs the module under ``torchrun --standalone``."""
    skip_reason: str | None = None
    """Set when the contender cannot run here (a framework that is not installed)."""

    def command(self) -> list[str]:
        if self.nproc == 1:
            return [sys.executable, "-m", self.module, *self.args]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(self.nproc),
            "-m",
            self.module,
            *self.args,
        ]


@final
@dataclass(frozen=True)
class Comparison:
    key: str
    title: str
    baseline: str
    """The contender the ratios divide by."""
    metrics: tuple[Metric, ...]
    contenders: tuple[Contender, ...]
    notes: tuple[str, ...] = ()


@final
@dataclass
class ContenderResult:
    name: str
    status: Literal["ok", "skipped", "failed"] = "ok"
    note: str | None = None
    runs: list[dict[str, float]] = field(default_factory=list)

    def figures(self, key: str) -> list[float]:
        return [run[key] for run in self.runs if key in run]


def child_env() -> dict[str, str]:
    """One thread per process, and the project's code (not an installed copy) on the path."""
    env = dict(os.environ)
    # A suite launched from inside a distributed job must not hand its rank to the workers.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    paths = [str(REPO_ROOT / "src"), str(REPO_ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # Frameworks print banners and warnings; only the result line is read.
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def run_once(contender: Contender) -> dict[str, float]:
    """Run one fresh process of ``contender`` and return the figures it printed.

    The process (every rank of it) gets a fresh scratch directory in ``BENCH_SCRATCH``, removed
    afterwards, for the checkpoints it writes.
    """
    with tempfile.TemporaryDirectory(prefix="trainkit-bench-") as scratch:
        env = child_env()
        env["BENCH_SCRATCH"] = scratch
        # A session of its own, so a hung run's whole gang (torchrun and its workers) is killed.
        process = subprocess.Popen(
            contender.command(),
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, stderr = process.communicate(timeout=PROCESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill_session(process)
            raise RuntimeError(
                f"{contender.name} did not finish within {PROCESS_TIMEOUT_S:.0f} s and was killed."
            ) from None
        except BaseException:
            # Interrupted (Ctrl-C, SIGTERM): take the run's processes down with the suite.
            _kill_session(process)
            raise
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if process.returncode != 0 or not lines:
        tail = (stderr or stdout).strip().splitlines()[-8:]
        raise RuntimeError(
            f"{contender.name} exited with status {process.returncode} and "
            f"{'no' if not lines else 'a'} result line: " + " | ".join(tail)
        )
    figures: dict[str, float] = json.loads(lines[-1][len(RESULT_PREFIX) :])
    return figures


def _kill_session(process: subprocess.Popen[str]) -> None:
    """SIGTERM first: torchrun starts its workers in sessions of their own and stops them only
    when it is asked to stop itself; SIGKILL if that does not end the run."""
    for signum, grace_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        # The session may be gone already: every process in it exited on its own.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)
        try:
            process.communicate(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_comparison(
    comparison: Comparison,
    *,
    runs: int,
    log: Callable[[str], None] = print,
) -> list[ContenderResult]:
    """Run every available contender ``runs`` times, alternating, each run a fresh process."""
    results = {c.name: ContenderResult(name=c.name) for c in comparison.contenders}
    active: list[Contender] = []
    for contender in comparison.contenders:
        if contender.skip_reason is not None:
            results[contender.name].status = "skipped"
            results[contender.name].note = contender.skip_reason
        else:
            active.append(contender)
    if not active:
        # One line for a comparison none of whose contenders can run (the GPU cases on a CPU).
        reasons = sorted({str(results[c.name].note) for c in comparison.contenders})
        log(f"  {comparison.key}: skipped: {'; '.join(reasons)}")
    num_failed = dict.fromkeys(results, 0)
    for run_nr in range(1, runs + 1):
        for contender in active:
            result = results[contender.name]
            # One failed run may be a fluke of a busy machine; a second one is not.
            if num_failed[contender.name] >= MAX_FAILED_RUNS:
                continue
            started = time.perf_counter()
            try:
                result.runs.append(run_once(contender))
            except RuntimeError as ex:
                num_failed[contender.name] += 1
                result.status = "failed"
                result.note = f"{num_failed[contender.name]} run(s) failed, the last: {ex}"
                log(f"  {comparison.key} {contender.name}: FAILED: {ex}")
                continue
            log(
                f"  {comparison.key} run {run_nr}/{runs} {contender.name}: "
                f"{_brief(result.runs[-1])} ({time.perf_counter() - started:.1f} s)"
            )
    return [results[c.name] for c in comparison.contenders]


def _brief(figures: Mapping[str, float]) -> str:
    return ", ".join(f"{key}={value:.4g}" for key, value in figures.items())


def summarize(values: Sequence[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def summarize_comparison(
    comparison: Comparison, results: Sequence[ContenderResult]
) -> dict[str, Any]:
    """The JSON record of one comparison: per contender and metric, statistics and the ratio."""
    by_name = {result.name: result for result in results}
    baseline = by_name[comparison.baseline]
    contenders: list[dict[str, Any]] = []
    for result in results:
        record: dict[str, Any] = {
            "name": result.name,
            "status": result.status,
            "note": result.note,
            "num_runs": len(result.runs),
            "runs": result.runs,
            "metrics": {},
        }
        for metric in comparison.metrics:
            values = result.figures(metric.key)
            if not values:
                continue
            stats: dict[str, float | None] = dict(summarize(values))
            base_values = baseline.figures(metric.key)
            base = summarize(base_values)[metric.summary] if base_values else None
            own = summarize(values)[metric.summary]
            stats["ratio"] = own / base if base and metric.ratio else None
            record["metrics"][metric.key] = stats
        contenders.append(record)
    return {
        "key": comparison.key,
        "title": comparison.title,
        "baseline": comparison.baseline,
        "notes": list(comparison.notes),
        "metrics": [
            {
                "key": m.key,
                "label": m.label,
                "unit": m.unit,
                "summary": m.summary,
                "ratio": m.ratio,
            }
            for m in comparison.metrics
        ],
        "contenders": contenders,
    }
