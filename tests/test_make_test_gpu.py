"""``make test-gpu`` on a machine without CUDA: one line saying so, exit status 0."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: it would run")
@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_make_test_gpu_without_cuda_says_so_in_one_line(tmp_path: Path) -> None:
    # A stand-in for the Makefile's .venv: this Python (and its packages), marked installed
    # after pyproject.toml changed last, so make goes straight to the target.
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    python = venv_bin / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    (venv_bin / ".installed").touch()
    newer = (REPO_ROOT / "pyproject.toml").stat().st_mtime + 1
    os.utime(venv_bin / ".installed", (newer, newer))
    result = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-C",
            str(REPO_ROOT),
            "test-gpu",
            f"VENV={venv_bin.parent}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "test-gpu: no CUDA device here; skipping the CUDA suite.\n"
