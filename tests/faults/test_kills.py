"""kill -9 of a 2-rank job at random steps and at random moments of its checkpoint saves.

Every trial kills a real ``torchrun`` job of ``tests/workers/resume_toy.py`` (10 steps, a
checkpoint every 2), then launches it again. It survives when every checkpoint committed before
the kill is still there and verifies, and the rerun ends with exactly the parameters of the
uninterrupted run. Kill moments come from a fixed seed.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
from torch import Tensor

from tests.faults.conftest import Tally, out_dir, trial_counts
from tests.faults.jobs import (
    committed,
    identical,
    kill_job,
    load_params,
    rank_log,
    run_job,
    start_job,
    wait_for,
    wait_until_gone,
)

pytestmark = [pytest.mark.faults, pytest.mark.distributed]

PACING = ("step_sleep=0.2", "mark_steps=true")


def rerun_and_judge(
    tally: Tally, out: Path, before: list[int], reference: dict[str, Tensor], *overrides: str
) -> None:
    """Count the trial: committed checkpoints kept, the rerun bit-identical to the reference."""
    after_kill = committed(out)
    lost = sorted(set(before) - set(after_kill))
    result = run_job(out, *overrides)
    resumed_from = max(after_kill, default=None)
    survived = (
        result.returncode == 0
        and not lost
        and identical(load_params(out), reference)
        and (
            resumed_from is None
            or f"from the checkpoint of step {resumed_from}." in rank_log(out, 0)
        )
    )
    tally.add(
        survived=survived,
        data_lost=len(lost),
        detail=f"{out}: exit {result.returncode}, lost {lost}\n{result.stderr[-3000:]}",
    )


# `make test-all` only: in `make test`, test_resume kills a rank with SIGKILL mid-step (sync and
# async saves, fast and public DCP) and inside a save, and checks each rerun is bit-identical.
@pytest.mark.slow
@pytest.mark.parametrize("trials", trial_counts(1, 10))
def test_kill_9_of_the_whole_job_at_random_steps(
    trials: int, reference: dict[str, Tensor], tmp_path: Path, tally: Tally
) -> None:
    rng = random.Random(11)
    for trial in range(trials):
        out = out_dir(tmp_path, trial)
        kill_after_step, delay = rng.randint(1, 9), rng.uniform(0.0, 0.25)
        job = start_job(out, *PACING)
        assert wait_for(out / "progress" / f"step_{kill_after_step}", job), job.stderr()
        time.sleep(delay)  # somewhere inside the next step, or its save
        before = committed(out)
        kill_job(job)
        rerun_and_judge(tally, out, before, reference, *PACING)
    tally.check()


# `make test-all` only: in `make test`, test_resume kills a synchronous save at fixed points and
# crashes an asynchronous one.
@pytest.mark.slow
@pytest.mark.parametrize("trials", [pytest.param(10, id="10_trials")])
def test_kill_9_during_checkpoint_saves_sync_and_async(
    trials: int, reference: dict[str, Tensor], tmp_path: Path, tally: Tally
) -> None:
    # Each DCP write and the manifest take 0.15 s longer: a save lasts about 0.8 s, the window
    # the kill lands in. Even trials save asynchronously, odd ones synchronously; some kill one
    # rank, some the whole job.
    rng = random.Random(22)
    for trial in range(trials):
        out = out_dir(tmp_path, trial)
        mode = "async_checkpoint=false" if trial % 2 else "async_checkpoint=true"
        overrides = ("save_sleep=0.15", "mark_steps=true", mode)
        save_step, delay = rng.choice([2, 4, 6, 8]), rng.uniform(0.0, 0.9)
        whole_job = rng.random() < 0.5
        job = start_job(out, *overrides)
        # The step's file is written before its save starts.
        assert wait_for(out / "progress" / f"step_{save_step}", job), job.stderr()
        time.sleep(delay)
        before = committed(out)
        if whole_job:
            kill_job(job)
        else:
            workers = job.workers()
            os.kill(rng.choice(workers), signal.SIGKILL)
            job.wait()  # torchrun tears the other rank down
            wait_until_gone(workers)
        rerun_and_judge(tally, out, before, reference, *overrides)
    tally.check()
