"""Shared fixtures: real ``torchrun`` launches and small helpers for reading run output."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for child processes: the repo root importable, W&B offline, quiet threads."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), str(REPO_ROOT / "src"), env.get("PYTHONPATH", "")]
    )
    env.setdefault("WANDB_MODE", "offline")
    env["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    if extra:
        env.update(extra)
    return env


def torchrun_command(nproc: int, target: Sequence[str], *, max_restarts: int = 0) -> list[str]:
    """``python -m torch.distributed.run`` on a free local port, for ``nproc`` processes."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--nnodes=1",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-backend=c10d",
        f"--max-restarts={max_restarts}",
        *target,
    ]


def torchrun(
    nproc: int,
    *target: str,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    max_restarts: int = 0,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``torchrun`` with ``nproc`` processes on a script or ``-m module`` and its arguments.

    Returns the completed process; asserts nothing, so tests can check failing runs too.
    """
    return subprocess.run(
        torchrun_command(nproc, target, max_restarts=max_restarts),
        env=child_env(env),
        cwd=cwd or REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


RunTorch = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run_torchrun() -> RunTorch:
    """:func:`torchrun`, as a fixture."""
    return torchrun


def assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    """Fail with the child's output when it did not exit 0."""
    assert result.returncode == 0, (
        f"exit {result.returncode}\n--- stdout ---\n{result.stdout[-6000:]}"
        f"\n--- stderr ---\n{result.stderr[-6000:]}"
    )
