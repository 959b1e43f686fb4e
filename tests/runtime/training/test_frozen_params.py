"""Parameters with ``requires_grad=False`` in every layout: unchanged by training, no gradient,
no optimizer state, left out of the gradient norm, checkpointed and restored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpoint.dcp_io import load_whole
from tests.conftest import RunTorch, assert_ok, read_jsonl
from tests.workers.frozen_params import FROZEN


def check_frozen_run(out: Path) -> None:
    report = torch.load(out / "report.pt", weights_only=True)
    for name in FROZEN:
        assert torch.equal(report["trained"][name], report["built"][name]), name
        # The resume built other weights; the checkpoint's frozen ones replaced them.
        assert torch.equal(report["resumed"][name], report["built"][name]), name
    assert report["frozen_with_grad"] == []

    published = {r["step_nr"]: r["grad_norm"] for r in read_jsonl(out / "metrics" / "train.jsonl")}
    assert sorted(published) == [1, 2, 3, 4, 5, 6]
    for step_nr, norm in report["norms"].items():
        assert published[step_nr] == pytest.approx(norm, rel=1e-5), step_nr

    optimizer = load_whole(out / "checkpoints" / "step_6" / "optimizer")
    assert set(optimizer["state"]) == {"up.bias", "down.weight", "down.bias"}
    model = load_whole(out / "checkpoints" / "step_6" / "model")
    for name in FROZEN:
        assert torch.equal(model[name], report["built"][name]), name


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("nproc", "options"),
    [
        # recipes.lm's LoRA test trains a partly frozen model under FSDP2 in `make test`.
        pytest.param(2, {"kinds": ["ddp", "fsdp"]}, marks=pytest.mark.slow),
        pytest.param(2, {"kinds": ["tp"], "tp_size": 2}, id="tp", marks=pytest.mark.slow),
        pytest.param(4, {"kinds": ["hsdp"], "dp_shard_size": 2}, id="hsdp", marks=pytest.mark.slow),
        pytest.param(4, {"kinds": ["fsdp"], "tp_size": 2}, id="fsdp-tp", marks=pytest.mark.slow),
    ],
    ids=["ddp-fsdp", "tp", "hsdp", "fsdp-tp"],
)
def test_frozen_parameters_stay_frozen_and_are_restored(
    tmp_path: Path, run_torchrun: RunTorch, nproc: int, options: dict[str, object]
) -> None:
    result = run_torchrun(
        nproc, "tests/workers/frozen_params.py", str(tmp_path), json.dumps(options)
    )
    assert_ok(result)
    for kind in options["kinds"]:  # type: ignore[attr-defined]
        check_frozen_run(tmp_path / kind)
