"""A rank that dies mid-step under pipeline parallelism: the other stage's rank exits within the
collective timeout, by itself. No hang.

The two ranks run without ``torchrun``, whose agent would tear the survivor down the moment its
peer died: here only the survivor's own point-to-point sends and receives can end it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, child_env, free_port
from tests.faults.jobs import HANG_GUARD

pytestmark = [pytest.mark.faults, pytest.mark.distributed]

TIMEOUT = 10.0
"""The gangs' collective timeout, in seconds."""


@pytest.mark.slow
def test_a_stage_killed_mid_step_ends_the_other_within_the_collective_timeout(
    tmp_path: Path,
) -> None:
    port = str(free_port())
    logs = [(tmp_path / f"rank_{rank}.log").open("w") for rank in range(2)]
    ranks = [
        subprocess.Popen(
            [sys.executable, "tests/workers/pipeline_fault.py", str(tmp_path), str(TIMEOUT)],
            env=child_env(
                {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                }
            ),
            cwd=REPO_ROOT,
            stdout=logs[rank],
            stderr=subprocess.STDOUT,
        )
        for rank in range(2)
    ]
    try:
        # The last stage's rank kills itself in the forward of step 2's third microbatch.
        assert ranks[1].wait(timeout=HANG_GUARD) == -9, (tmp_path / "rank_1.log").read_text()
        assert (tmp_path / "dying").exists()
        died = time.monotonic()
        returncode = ranks[0].wait(timeout=HANG_GUARD)
        waited = time.monotonic() - died
    finally:
        for process in ranks:
            process.kill()
            process.wait()
        for log in logs:
            log.close()
    output = (tmp_path / "rank_0.log").read_text()
    assert returncode not in (0, None) and not (tmp_path / "finished").exists(), output
    assert waited < TIMEOUT, f"the first stage exited {waited:.1f} s after the last died\n{output}"
    # The error is the pipeline's: a receive or send that lost its peer mid-step.
    assert "pipelining/schedules.py" in output, output
