"""Distributed math: every parallel layout makes the same updates as one process would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from gangs.torch_versions import PRIVATE_APIS_ENV_VAR
from tests.conftest import RunTorch, assert_ok, rank_reports, torchrun

pytestmark = pytest.mark.distributed

WORKER = "tests/workers/train_toy.py"


def train(run_torchrun: RunTorch, out: Path, nproc: int, **options: Any) -> dict[str, Tensor]:
    result = run_torchrun(nproc, WORKER, str(out), json.dumps(options))
    assert_ok(result)
    params: dict[str, Tensor] = torch.load(out / "params.pt", weights_only=True)
    return params


def assert_same_params(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def single_process_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tensor]:
    """DP=1, batch 8, clipped: the run every layout below must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    return train(torchrun, out, 1, batch_size=8, max_gradient_norm=0.5)


def test_reference_run_moved_the_weights(
    single_process_reference: dict[str, Tensor],
) -> None:
    from tests.workers.train_toy import ToyModel

    torch.manual_seed(0)
    initial = ToyModel().state_dict()
    moved = [not torch.allclose(initial[k], single_process_reference[k]) for k in initial]
    assert all(moved)


def test_dp2_matches_dp1_with_doubled_batch(
    run_torchrun: RunTorch, tmp_path: Path, single_process_reference: dict[str, Tensor]
) -> None:
    params = train(run_torchrun, tmp_path, 2, batch_size=4, max_gradient_norm=0.5)
    assert_same_params(params, single_process_reference)


def test_accumulation_matches_one_batch_of_twice_the_size(
    run_torchrun: RunTorch, tmp_path: Path, single_process_reference: dict[str, Tensor]
) -> None:
    params = train(run_torchrun, tmp_path, 1, batch_size=4, num_accumulate=2, max_gradient_norm=0.5)
    assert_same_params(params, single_process_reference)


def test_dp2_with_accumulation_matches_dp1(
    run_torchrun: RunTorch, tmp_path: Path, single_process_reference: dict[str, Tensor]
) -> None:
    params = train(run_torchrun, tmp_path, 2, batch_size=2, num_accumulate=2, max_gradient_norm=0.5)
    # The DP shards interleave, so the same 8 examples form each step in another grouping.
    assert_same_params(params, single_process_reference)


def test_fsdp2_matches_ddp(
    run_torchrun: RunTorch, tmp_path: Path, single_process_reference: dict[str, Tensor]
) -> None:
    params = train(run_torchrun, tmp_path, 2, batch_size=4, max_gradient_norm=0.5, kind="fsdp")
    assert_same_params(params, single_process_reference)


def test_tp2_matches_tp1(
    run_torchrun: RunTorch, tmp_path: Path, single_process_reference: dict[str, Tensor]
) -> None:
    params = train(run_torchrun, tmp_path, 2, batch_size=8, max_gradient_norm=0.5, tp_size=2)
    assert_same_params(params, single_process_reference)


@pytest.mark.parametrize(
    "paths",
    # make test: torch's private kernels; make test-all: also the public path, bit for bit.
    [
        pytest.param(("private",), id="private"),
        pytest.param(("private", "public"), marks=pytest.mark.slow, id="both"),
    ],
)
def test_dp2_x_tp2_matches_dp1_with_the_same_bits_on_both_torch_paths(
    run_torchrun: RunTorch,
    tmp_path: Path,
    single_process_reference: dict[str, Tensor],
    monkeypatch: pytest.MonkeyPatch,
    paths: tuple[str, ...],
) -> None:
    # The public path normalizes and clips the DTensor gradients' local shards one by one.
    trained = {}
    for path in paths:
        monkeypatch.setenv(PRIVATE_APIS_ENV_VAR, path)
        (tmp_path / path).mkdir()
        trained[path] = train(
            run_torchrun,
            tmp_path / path,
            4,
            batch_size=4,
            max_gradient_norm=0.5,
            tp_size=2,
            kind="fsdp",
        )
        assert_same_params(trained[path], single_process_reference)
    for name, private in trained["private"].items():
        for path in paths[1:]:
            assert torch.equal(private, trained[path][name]), name


@pytest.mark.parametrize(
    "with_ddp",
    # make test: HSDP against one process; make test-all: also DDP on the same 4 ranks.
    [False, pytest.param(True, marks=pytest.mark.slow)],
)
def test_hsdp_2x2_matches_ddp_on_4_and_dp1(
    run_torchrun: RunTorch,
    tmp_path: Path,
    single_process_reference: dict[str, Tensor],
    with_ddp: bool,
) -> None:
    (tmp_path / "hsdp").mkdir()
    (tmp_path / "ddp").mkdir()
    hsdp = train(
        run_torchrun,
        tmp_path / "hsdp",
        4,
        batch_size=2,
        max_gradient_norm=0.5,
        kind="hsdp",
        dp_shard_size=2,
    )
    assert_same_params(hsdp, single_process_reference)
    if with_ddp:
        ddp = train(run_torchrun, tmp_path / "ddp", 4, batch_size=2, max_gradient_norm=0.5)
        assert_same_params(ddp, single_process_reference)


@pytest.mark.parametrize(
    "torch_private_apis",
    # make test: the public mesh (DeviceMesh.from_group), which no other test trains over; the
    # private one (DeviceMesh._flatten) also makes the DP gang of every HSDP test.
    ["public", pytest.param("private", marks=pytest.mark.slow)],
    indirect=True,
)
@pytest.mark.usefixtures("torch_private_apis")
def test_fsdp_over_the_whole_dp_gang_of_an_hsdp_layout_matches_dp1(
    run_torchrun: RunTorch, tmp_path: Path, single_process_reference: dict[str, Tensor]
) -> None:
    # kind="fsdp" shards over Gangs.dp_mesh: HSDP's dims flattened on the private path, a mesh
    # of the DP gang's public process group on the public one.
    params = train(
        run_torchrun,
        tmp_path,
        4,
        batch_size=2,
        max_gradient_norm=0.5,
        kind="fsdp",
        dp_shard_size=2,
    )
    assert_same_params(params, single_process_reference)


@pytest.mark.slow
def test_hsdp_2x2_x_tp2_on_8_processes_matches_dp1(
    run_torchrun: RunTorch, tmp_path: Path, single_process_reference: dict[str, Tensor]
) -> None:
    # The three-dimensional layout of a multi-node run: TP within a pair, shards within a node,
    # replicas across nodes. Eight processes on this machine's cores take a while: `make test-all`.
    params = train(
        run_torchrun,
        tmp_path,
        8,
        batch_size=2,
        max_gradient_norm=0.5,
        tp_size=2,
        kind="hsdp",
        dp_shard_size=2,
    )
    assert_same_params(params, single_process_reference)


def _collectives_per_step(
    run_torchrun: RunTorch, tmp_path: Path, kind: str
) -> list[tuple[list[dict[str, int]], list[dict[str, int]]]]:
    """Each rank's collectives on the root gang: of the steps that do not publish (1, 2, 4, 5),
    and of those that do (3, 6), with their publish."""
    assert_ok(run_torchrun(2, "tests/workers/collective_count.py", str(tmp_path), kind))
    per_rank = []
    for per_step in rank_reports(tmp_path, 2):
        assert len(per_step) == 6
        publishing = [per_step[2], per_step[5]]
        per_rank.append(([c for i, c in enumerate(per_step) if i not in (2, 5)], publishing))
    return per_rank


def test_a_ddp_step_makes_one_collective_beside_ddps_own_and_does_not_wait_for_it(
    run_torchrun: RunTorch, tmp_path: Path
) -> None:
    for steps, publishes in _collectives_per_step(run_torchrun, tmp_path, "ddp"):
        # DDP reduces the gradients on its own process group; the step's counts take one
        # all-reduce of their own, started before the last backward; no blocking one.
        assert steps == [{"all_reduce_async": 1}] * 4
        # A publish checks for non-finite values and gathers the peak memory.
        assert publishes == [{"all_reduce_async": 1, "all_reduce": 2}] * 2


@pytest.mark.slow
def test_accumulated_micro_batches_leave_ddps_gradients_unreduced_until_the_last(
    run_torchrun: RunTorch, tmp_path: Path
) -> None:
    for steps, _ in _collectives_per_step(run_torchrun, tmp_path, "ddp-hooked"):
        # The toy model's gradients fit one bucket: one all-reduce of it a step, not one per
        # micro-batch.
        assert steps == [{"ddp_bucket": 1, "all_reduce_async": 1}] * 4


def test_an_fsdp_step_makes_one_collective_of_its_own_and_does_not_wait_for_it(
    run_torchrun: RunTorch, tmp_path: Path
) -> None:
    for steps, publishes in _collectives_per_step(run_torchrun, tmp_path, "fsdp"):
        # One all-reduce of the counts starts before the last backward; no blocking one.
        assert steps == [{"all_reduce_async": 1}] * 4
        assert publishes == [{"all_reduce_async": 1, "all_reduce": 2}] * 2
