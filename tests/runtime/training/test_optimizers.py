"""Several optimizers and LR schedulers, and sparse gradients (``nn.Embedding(sparse=True)``
trained by ``SparseAdam`` beside ``AdamW``), on one process and under DDP."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from gangs import Gangs
from tests.conftest import RunTorch, assert_ok, read_jsonl, torchrun
from tests.workers.train_sparse import (
    SparseDataset,
    SparseModel,
    collate,
    make_optimizers,
    make_trainer,
    result_of,
)

WORKER = "tests/workers/train_sparse.py"


def train_here(out: Path, **options: Any) -> dict[str, Any]:
    trainer, module, optimizers = make_trainer(out, options, Gangs.single())
    assert trainer.run() == 0
    return result_of(module, optimizers)


def hand_loop(
    *, num_steps: int, batch_size: int, num_accumulate: int, max_norm: float | None = None
) -> tuple[dict[str, Tensor], list[float]]:
    """The same training written by hand: the mean loss over the step's targets, the norm over
    dense and sparse gradients, both optimizers and both schedulers once per step."""
    torch.manual_seed(0)
    model = SparseModel()
    optimizers, schedulers = make_optimizers(model)
    data = SparseDataset(64)
    per_step = batch_size * num_accumulate
    norms = []
    for step in range(num_steps):
        start = step * per_step
        for micro in range(num_accumulate):
            index = list(range(start + micro * batch_size, start + (micro + 1) * batch_size))
            batch = collate([data[i] for i in index])
            loss = (model(batch.ids) - batch.y).pow(2).sum() / per_step
            loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.stack(
            [(g.coalesce().values() if g.is_sparse else g).norm() for g in grads]
        ).norm()
        norms.append(float(norm))
        if max_norm is not None:
            coef = min(1.0, max_norm / (float(norm) + 1e-6))
            for p in model.parameters():
                assert p.grad is not None
                p.grad = p.grad.coalesce() * coef if p.grad.is_sparse else p.grad * coef
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        for scheduler in schedulers:
            scheduler.step()
    return model.state_dict(), norms


def assert_close_params(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.usefixtures("torch_private_apis")
def test_sparse_and_dense_optimizers_match_a_hand_written_loop(tmp_path: Path) -> None:
    result = train_here(tmp_path, batch_size=4, num_accumulate=2, max_num_steps=6)
    expected, norms = hand_loop(num_steps=6, batch_size=4, num_accumulate=2)
    assert_close_params(result["params"], expected)
    torch.manual_seed(0)
    initial = SparseModel().state_dict()
    assert not torch.equal(result["params"]["table.weight"], initial["table.weight"])

    records = read_jsonl(tmp_path / "metrics" / "train.jsonl")
    assert [r["grad_norm"] for r in records] == pytest.approx(norms, rel=1e-5)
    # StepLR halves both dense groups every 2 steps; LambdaLR divides the sparse one by 1+step.
    last = records[-1]
    assert last["lr"] == pytest.approx(0.01 / 8)
    assert last["lr/opt0/group1"] == pytest.approx(0.03 / 8)
    assert last["lr/opt1/group0"] == pytest.approx(0.05 / 7)
    assert records[0]["lr/opt1/group0"] == pytest.approx(0.05 / 2)


@pytest.mark.usefixtures("torch_private_apis")
def test_clipping_counts_the_sparse_gradients(tmp_path: Path) -> None:
    result = train_here(tmp_path, batch_size=8, max_num_steps=3, max_gradient_norm=0.05)
    expected, norms = hand_loop(num_steps=3, batch_size=8, num_accumulate=1, max_norm=0.05)
    unclipped, _ = hand_loop(num_steps=3, batch_size=8, num_accumulate=1)
    assert all(norm > 0.05 for norm in norms)
    assert_close_params(result["params"], expected)
    assert not torch.allclose(expected["table.weight"], unclipped["table.weight"])
    # The dense norm alone is smaller than what was published: the table's rows count.
    records = read_jsonl(tmp_path / "metrics" / "train.jsonl")
    assert [r["grad_norm"] for r in records] == pytest.approx(norms, rel=1e-5)


@pytest.mark.usefixtures("torch_private_apis")
def test_a_nan_sparse_gradient_in_fp16_skips_both_optimizers(tmp_path: Path) -> None:
    result = train_here(
        tmp_path, batch_size=8, max_num_steps=3, dtype="float16", nan_sparse_at_step=2
    )
    # Three steps, one skipped: each optimizer stepped twice.
    dense, sparse = result["optimizers"]
    assert {int(s["step"]) for s in dense["state"].values()} == {2}
    assert {int(s["step"]) for s in sparse["state"].values()} == {2}
    assert all(torch.isfinite(p).all() for p in result["params"].values())
    records = read_jsonl(tmp_path / "metrics" / "train.jsonl")
    assert [r["loss_scale"] for r in records] == [128.0, 64.0, 64.0]


def test_optimizers_must_not_share_parameters(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = SparseModel()
    dense, _ = make_optimizers(model)
    twice = torch.optim.SGD(model.up.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="more than one of the optimizers"):
        make_trainer_with(tmp_path, model, [dense[0], twice])
    with pytest.raises(ValueError, match="non-empty sequence"):
        make_trainer_with(tmp_path, model, [])


def make_trainer_with(tmp_path: Path, model: SparseModel, optimizers: Any) -> None:
    from checkpoint import CheckpointManager
    from runtime import MapDataReader, Trainer
    from tests.workers.train_sparse import SparseUnit

    gangs = Gangs.single()
    Trainer(
        unit=SparseUnit(model),
        data_reader=MapDataReader(
            dataset=SparseDataset(8), batch_size=4, collate=collate, gang=gangs.dp
        ),
        optimizer=optimizers,
        checkpoint_manager=CheckpointManager(tmp_path / "checkpoints", gangs),
        gangs=gangs,
        progress=False,
    )


# ------------------------------------------------------------------------ under torchrun


def train_dp2(run: RunTorch, out: Path, **options: Any) -> dict[str, Any]:
    result = run(2, WORKER, str(out), json.dumps(options))
    assert_ok(result)
    loaded: dict[str, Any] = torch.load(out / "result.pt", weights_only=True)
    return loaded


DP2_OPTIONS: dict[str, Any] = {"batch_size": 4, "max_num_steps": 6, "checkpoint_every": 2}


@pytest.fixture(scope="module")
def killed_dp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """One launch: the uninterrupted two-rank run in ``OUT/reference``, then the same run
    SIGKILLed after step 5 in ``OUT``; returns ``OUT`` and the launch's result."""
    out = tmp_path_factory.mktemp("dp2")
    options = DP2_OPTIONS | {"sigkill_after_step": 5, "reference_first": True}
    return out, torchrun(2, WORKER, str(out), json.dumps(options))


@pytest.fixture(scope="module")
def dp2_dir(killed_dp2: tuple[Path, Any]) -> Path:
    """The uninterrupted two-rank run."""
    return killed_dp2[0] / "reference"


@pytest.fixture(scope="module")
def dp2_reference(dp2_dir: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(dp2_dir / "result.pt", weights_only=True)
    return loaded


@pytest.mark.distributed
def test_dp2_matches_dp1_with_doubled_batch(tmp_path: Path, dp2_reference: dict[str, Any]) -> None:
    single = train_here(tmp_path, batch_size=8, max_num_steps=6)
    assert_close_params(dp2_reference["params"], single["params"])


@pytest.mark.distributed
def test_kill_9_resumes_both_optimizers_bit_identically(
    run_torchrun: RunTorch, killed_dp2: tuple[Path, Any], dp2_reference: dict[str, Any]
) -> None:
    out, killed = killed_dp2
    assert killed.returncode != 0
    assert not (out / "result.pt").exists()
    assert (out / "checkpoints" / "step_4").is_dir()
    resumed = train_dp2(run_torchrun, out, **DP2_OPTIONS)
    # The rerun went on from step 4's checkpoint, not from scratch.
    steps = [r["step_nr"] for r in read_jsonl(out / "metrics" / "train.jsonl")]
    assert steps.count(1) == 1 and steps[-2:] == [5, 6], steps
    for name, value in dp2_reference["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    for got, want in zip(resumed["optimizers"], dp2_reference["optimizers"], strict=True):
        assert got["param_groups"] == want["param_groups"]
        for key, state in want["state"].items():
            for field, value in state.items():
                same = (
                    torch.equal(got["state"][key][field], value)
                    if isinstance(value, Tensor)
                    else got["state"][key][field] == value
                )
                assert same, (key, field)
    assert math.isfinite(float(resumed["params"]["table.weight"].sum()))


@pytest.mark.distributed
def test_both_optimizers_reshard_from_two_ranks_to_one(
    tmp_path: Path, dp2_dir: Path, dp2_reference: dict[str, Any]
) -> None:
    # Step 4 of the two-rank run, resumed on one process with the doubled batch.
    shutil.copytree(dp2_dir / "checkpoints" / "step_4", tmp_path / "checkpoints" / "step_4")
    resumed = train_here(tmp_path, batch_size=8, max_num_steps=6, reshard_on_resume=True)
    steps = [r["step_nr"] for r in read_jsonl(tmp_path / "metrics" / "train.jsonl")]
    assert steps == [5, 6]
    assert_close_params(resumed["params"], dp2_reference["params"])
    for got, want in zip(resumed["optimizers"], dp2_reference["optimizers"], strict=True):
        assert {int(s["step"]) for s in got["state"].values()} == {6}
        for key, state in want["state"].items():
            for field, value in state.items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    torch.testing.assert_close(
                        got["state"][key][field], value, rtol=1e-4, atol=1e-6
                    )
