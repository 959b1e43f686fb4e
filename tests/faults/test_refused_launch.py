"""A launch that one rank refuses ends on every rank within seconds, with the reason.

Without the launch barrier, the ranks that did not refuse wait for the refusing one inside the
process group's rendezvous, deaf to torchrun's SIGTERM, until torchrun kills them 30 s later.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.cli.run_lock import RunLock
from tests.conftest import REPO_ROOT, child_env, free_port, torchrun_command

pytestmark = [pytest.mark.faults, pytest.mark.distributed]

RECIPE = ["-m", "tests.runtime.cli.cli_recipe"]

# A refused launch takes about 5 s on a quiet machine, most of it importing torch; a hung one
# takes over 30 s (torchrun's SIGTERM, ignored, then its SIGKILL), which SIGKILLED also shows.
BOUND_S = 20.0


def time_bound() -> float:
    """BOUND_S, stretched by how overloaded the machine is now: start-up (importing torch in
    every process at once) slows in proportion, and a busy CI host must not fail a prompt
    refusal."""
    overload = os.getloadavg()[0] / (os.cpu_count() or 1)
    return BOUND_S * max(1.0, overload)


SIGKILLED = "forcefully exiting via 9"


@pytest.fixture
def held_dir(tmp_path: Path) -> Iterator[Path]:
    """An output directory that a live run (this test) holds."""
    out = tmp_path / "run"
    out.mkdir()
    lock = RunLock(out)
    lock.acquire()
    yield out
    lock.release()


def launch(*commands: list[str]) -> tuple[list[subprocess.CompletedProcess[str]], float]:
    """Start every command at once; their results and the seconds until the last ended."""
    start = time.monotonic()
    processes = [
        subprocess.Popen(
            command,
            env=child_env(),
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for command in commands
    ]
    results = []
    for command, process in zip(commands, processes, strict=True):
        stdout, stderr = process.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(command, process.returncode, stdout, stderr))
    return results, time.monotonic() - start


def error_lines(results: list[subprocess.CompletedProcess[str]]) -> list[str]:
    return [
        line
        for result in results
        for line in result.stderr.splitlines()
        if line.startswith("error: ")
    ]


def assert_refused_everywhere(
    results: list[subprocess.CompletedProcess[str]], elapsed: float, *, reason: str, ranks: int
) -> None:
    output = "\n".join(r.stderr for r in results)
    assert all(r.returncode != 0 for r in results), output
    bound = time_bound()
    assert elapsed < bound, f"the launch took {elapsed:.1f} s (bound {bound:.0f} s)\n{output}"
    assert SIGKILLED not in output, output
    # Every rank says why: the refusing one in its own words, the others naming it.
    lines = [line for line in error_lines(results) if reason in line]
    assert len(lines) == ranks, output


def test_a_launch_refused_by_rank_0_ends_on_every_rank(held_dir: Path) -> None:
    command = torchrun_command(2, [*RECIPE, str(held_dir)])
    results, elapsed = launch(command)
    assert_refused_everywhere(results, elapsed, reason="is in use by another run", ranks=2)
    assert any(line.startswith("error: rank 0: ") for line in error_lines(results))
    assert sorted(p.name for p in held_dir.iterdir()) == ["run.lock"]


def test_a_launch_refused_on_one_node_ends_on_the_other_node_too(held_dir: Path) -> None:
    """Two launchers, as on two machines: the second node's rank never sees rank 0's lock."""
    endpoint = f"127.0.0.1:{free_port()}"
    commands = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            "--rdzv-id=refused",
            *RECIPE,
            str(held_dir),
        ]
        for _ in range(2)
    ]
    results, elapsed = launch(*commands)
    assert_refused_everywhere(results, elapsed, reason="is in use by another run", ranks=2)
    # Each launcher's worker printed one of the two lines.
    assert all(len(error_lines([r])) == 1 for r in results)


def test_a_rank_that_rejects_its_config_ends_the_launch_with_its_reason(tmp_path: Path) -> None:
    """Rank 1 fails while the recipe builds, before the process group: rank 0, waiting for it
    there, stops with rank 1's reason."""
    command = torchrun_command(2, [*RECIPE, str(tmp_path / "run"), "--config", "fail_on_rank=1"])
    results, elapsed = launch(command)
    assert_refused_everywhere(results, elapsed, reason="is not readable on this rank", ranks=2)
    assert any(re.match(r"error: rank 1: data_dir", line) for line in error_lines(results))
