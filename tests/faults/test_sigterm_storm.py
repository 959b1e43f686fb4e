"""SIGTERM storms: several signals to every rank at random moments of start-up, steps,
validation and saves. The run exits at a step boundary with a good checkpoint, or before
training with no checkpoint, and the next launch ends exactly where an uninterrupted run does.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from pathlib import Path

import pytest
from torch import Tensor

from tests.faults.conftest import Tally, out_dir, trial_counts
from tests.faults.jobs import (
    HANG_GUARD,
    Job,
    committed,
    identical,
    load_params,
    rank_log,
    run_job,
    start_job,
    wait_for,
)

pytestmark = [pytest.mark.faults, pytest.mark.distributed]

# Validation after steps 3, 6 and 9; saves after even steps; each phase slowed to be hit.
PACING = (
    "validate_every=3",
    "valid_sleep=0.1",
    "save_sleep=0.1",
    "step_sleep=0.1",
    "mark_steps=true",
)
# Trial n storms at moment n (in this order, round and round): `make test`'s one trial hits a
# save, the moment that puts committed data at risk; `make test-all` hits every moment.
MOMENTS = {"save": [2, 4, 8], "step": [1, 5, 7], "validation": [3, 6], "start-up": None}


def storm(job: Job, rng: random.Random) -> None:
    """1 to 3 SIGTERMs to each worker, at random gaps."""
    signals = [(pid, n) for pid in job.workers() for n in range(rng.randint(1, 3))]
    rng.shuffle(signals)
    for pid, _ in signals:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        time.sleep(rng.uniform(0.0, 0.2))


def wait_for_workers(job: Job) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while len(job.workers()) < 2 and job.process.poll() is None:
        assert time.monotonic() < deadline, "torchrun started no workers"
        time.sleep(0.01)


def judge(out: Path) -> tuple[bool, str]:
    """Stopped at one step boundary on every rank with that step committed, or never trained."""
    logs = [rank_log(out, rank) for rank in (0, 1)]
    stops = {
        int(log.split("Stopped at step ", 1)[1].split()[0])
        for log in logs
        if "Stopped at step " in log
    }
    steps = committed(out) if (out / "checkpoints").exists() else []
    leftovers = sorted(p.name for p in (out / "checkpoints").glob("*.tmp")) if steps else []
    if stops:
        ok = len(stops) == 1 and max(steps, default=-1) == stops.pop() and not leftovers
        return ok, f"stopped at {stops}, committed {steps}, leftovers {leftovers}"
    trained = any("Training from step" in log for log in logs)
    return not trained and not steps, f"never stopped at a step; trained {trained}, {steps}"


# `make test-all` only: in `make test`, test_resume's SIGTERM to torchrun and to one process stop
# every rank at one step boundary, exit 75 and resume bit-identical.
@pytest.mark.slow
@pytest.mark.parametrize("trials", trial_counts(1, 10))
def test_sigterm_storms_stop_at_a_step_boundary_or_before_training(
    trials: int, reference: dict[str, Tensor], tmp_path: Path, tally: Tally
) -> None:
    rng = random.Random(13)
    moments = list(MOMENTS)
    for trial in range(trials):
        out = out_dir(tmp_path, trial)
        moment = moments[trial % len(moments)]
        job = start_job(out, *PACING)
        wait_for_workers(job)
        after_steps = MOMENTS[moment]
        if after_steps is None:
            time.sleep(rng.uniform(0.0, 3.0))
        else:
            assert wait_for(out / "progress" / f"step_{rng.choice(after_steps)}", job)
            time.sleep(rng.uniform(0.0, 0.3))
        storm(job, rng)
        code = job.wait()
        stopped_well, detail = judge(out)
        rerun = run_job(out, *PACING)
        survived = (code != 0 and stopped_well and rerun.returncode == 0) and identical(
            load_params(out), reference
        )
        tally.add(
            survived=survived,
            detail=f"{moment}: exit {code}, {detail}, rerun {rerun.returncode}\n"
            f"{job.stderr()[-2000:]}\n{rerun.stderr[-2000:]}",
        )
    tally.check()
