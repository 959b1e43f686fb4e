"""Loss spikes in real multi-process runs: a finite spike, a NaN, a spike right after a
checkpoint and one before the first checkpoint on two ranks, and a recipe run that stops on too
many rollbacks with exit status 1 and one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import REPO_ROOT, RunTorch, assert_ok, run_python
from tests.faults.conftest import Tally

pytestmark = [pytest.mark.faults, pytest.mark.distributed, pytest.mark.slow]

WORKER = "tests/workers/train_spike.py"
GUARD = {"window": 8, "min_history": 3, "factor": 3.0, "margin": 1}

# Two ranks of 4 examples a step: step k reads examples 8(k-1) .. 8k-1, the even ones on rank 0.
CASES: dict[str, tuple[dict[str, Any], str | None]] = {
    # Step 7, found at the publish of step 8: back to step 4, the data of steps 5..8 skipped.
    "finite spike": ({"poison_indices": [50]}, "skip 5..8"),
    "nan": ({"poison_indices": [50], "poison_factor": float("nan")}, "skip 5..8"),
    # Step 5, right after the checkpoint of step 4, found at step 6: the data of 5..6 skipped.
    "right after a checkpoint": ({"poison_indices": [33]}, "skip 5..6"),
    # Step 3, before the first checkpoint (step 4): nothing to roll back to.
    "before the first checkpoint": (
        {"poison_indices": [17], "guard": GUARD | {"min_history": 2}},
        None,
    ),
    "skip 5..8": ({"drop": [32, 64]}, None),
    "skip 5..6": ({"drop": [32, 48]}, None),
}


def test_spikes_on_two_ranks_roll_back_to_the_weights_of_runs_without_their_data(
    run_torchrun: RunTorch, tmp_path: Path, tally: Tally
) -> None:
    runs = {
        name: {"dataset_size": 128, "guard": GUARD} | options
        for name, (options, _) in CASES.items()
    }
    assert_ok(run_torchrun(2, WORKER, str(tmp_path), json.dumps(runs)))

    def result(name: str) -> tuple[Any, Any, dict[str, torch.Tensor]]:
        status, rollbacks = json.loads((tmp_path / name / "rollbacks_0.json").read_text())
        params = torch.load(tmp_path / name / "params.pt", weights_only=True)
        return status, rollbacks, params

    for name, (_, clean_name) in CASES.items():
        if clean_name is None:
            continue
        status, rollbacks, params = result(name)
        _, _, clean = result(clean_name)
        same = all(torch.equal(params[k], clean[k]) for k in clean)
        tally.add(
            survived=status == 0 and len(rollbacks) == 1 and same,
            detail=f"{name}: status {status}, rollbacks {rollbacks}, same weights {same}",
        )
    status, rollbacks, _ = result("before the first checkpoint")
    tally.add(
        survived=isinstance(status, str)
        and status.startswith("Loss spike at step 3 (loss ")
        and "before the first checkpoint, so there is nothing to roll back to" in status,
        detail=f"before the first checkpoint: {status}",
    )
    tally.check()


def test_a_recipe_run_with_too_many_rollbacks_exits_1_with_one_line(
    tmp_path: Path, tally: Tally
) -> None:
    # A factor just above 1 makes ordinary noise a spike: the second one stops the run.
    out = tmp_path / "run"
    result = run_python(
        "-m", "recipes.char_lm", str(out), "--config",
        "data.max_train_bytes=100000", "data.max_valid_bytes=10000", "data.seq_len=32",
        "data.batch_size=8", "model.dim=32", "model.num_heads=4", "model.ffn_dim=64",
        "model.num_layers=1", "trainer.publish_metrics_every_n_steps=5",
        "trainer.validate_every_n_steps=10", "trainer.checkpoint_every_n_steps=10",
        "trainer.max_num_steps=200", "trainer.loss_spike.enabled=true",
        "trainer.loss_spike.factor=1.01", "trainer.loss_spike.min_history=5",
        "trainer.loss_spike.max_rollbacks=1",
        cwd=REPO_ROOT, timeout=300,
    )  # fmt: skip
    lines = result.stderr.strip().splitlines()
    checkpoints = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    tally.add(
        survived=result.returncode == 1
        and lines[-1].startswith("error: Loss spike at step ")
        and "after 1 rollbacks within 1000 steps (max_rollbacks is 1): step " in lines[-1]
        and "Traceback" not in result.stderr
        and len(checkpoints) >= 1,
        detail=f"exit {result.returncode}: {result.stderr[-2000:]}",
    )
    tally.check()
