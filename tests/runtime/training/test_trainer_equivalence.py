"""Distributed math: every parallel layout makes the same updates as one process would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.conftest import RunTorch, assert_ok, in_process, rank_reports, torchrun
from tests.workers import train_toy

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


CLIPPED = {"max_gradient_norm": 0.5}

# The runs of each launch (one torchrun start-up each), by number of processes; those of two
# processes go in the shared two-rank launch.
RUNS: dict[int, dict[str, dict[str, Any]]] = {
    1: {
        "reference": {"batch_size": 8, **CLIPPED},
        "accumulation": {"batch_size": 4, "num_accumulate": 2, **CLIPPED},
    },
    2: {
        "dp2": {"batch_size": 4, **CLIPPED},
        "dp2_accumulation": {"batch_size": 2, "num_accumulate": 2, **CLIPPED},
        "fsdp2": {"batch_size": 4, "kind": "fsdp", **CLIPPED},
        "tp2": {"batch_size": 8, "tp_size": 2, **CLIPPED},
    },
    4: {
        **{
            f"dp2_tp2-{path}": {
                "batch_size": 4,
                "tp_size": 2,
                "kind": "fsdp",
                "torch_path": path,
                **CLIPPED,
            }
            for path in ("private", "public")
        },
        "hsdp2x2": {"batch_size": 2, "kind": "hsdp", "dp_shard_size": 2, **CLIPPED},
        "ddp4": {"batch_size": 2, **CLIPPED},
        **{
            f"fsdp_over_hsdp-{path}": {
                "batch_size": 2,
                "kind": "fsdp",
                "dp_shard_size": 2,
                "torch_path": path,
                **CLIPPED,
            }
            for path in ("private", "public")
        },
    },
}


@pytest.fixture(scope="module")
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``trained(nproc, run)``: the parameters of a run of :data:`RUNS`, each launch made once;
    the two-process runs are made in the shared two-rank launch (tests/workers/two_rank_checks),
    the one-process runs in this process (the worker's main, which needs no launcher for one)."""
    outs: dict[int, Path] = {}

    def get(nproc: int, run: str) -> dict[str, Tensor]:
        if nproc == 2 and nproc not in outs:
            outs[nproc] = request.getfixturevalue("two_rank_checks") / "equivalence"
        if nproc not in outs:
            out = tmp_path_factory.mktemp(f"runs_{nproc}")
            options = {"runs": RUNS[nproc]}
            if nproc == 1:
                result = in_process(lambda _: train_toy.main(out, options), [])
            else:
                result = torchrun(nproc, WORKER, str(out), json.dumps(options))
            assert_ok(result)
            outs[nproc] = out
        params: dict[str, Tensor] = torch.load(outs[nproc] / run / "params.pt", weights_only=True)
        return params

    return get


@pytest.fixture(scope="module")
def single_process_reference(trained: Any) -> dict[str, Tensor]:
    """DP=1, batch 8, clipped: the run every layout below must reproduce."""
    params: dict[str, Tensor] = trained(1, "reference")
    return params


def test_reference_run_moved_the_weights(
    single_process_reference: dict[str, Tensor],
) -> None:
    torch.manual_seed(0)
    initial = train_toy.ToyModel().state_dict()
    moved = [not torch.allclose(initial[k], single_process_reference[k]) for k in initial]
    assert all(moved)


def test_dp2_matches_dp1_with_doubled_batch(
    trained: Any, single_process_reference: dict[str, Tensor]
) -> None:
    assert_same_params(trained(2, "dp2"), single_process_reference)


def test_accumulation_matches_one_batch_of_twice_the_size(
    trained: Any, single_process_reference: dict[str, Tensor]
) -> None:
    assert_same_params(trained(1, "accumulation"), single_process_reference)


def test_dp2_with_accumulation_matches_dp1(
    trained: Any, single_process_reference: dict[str, Tensor]
) -> None:
    # The DP shards interleave, so the same 8 examples form each step in another grouping.
    assert_same_params(trained(2, "dp2_accumulation"), single_process_reference)


def test_fsdp2_matches_ddp(trained: Any, single_process_reference: dict[str, Tensor]) -> None:
    assert_same_params(trained(2, "fsdp2"), single_process_reference)


def test_tp2_matches_tp1(trained: Any, single_process_reference: dict[str, Tensor]) -> None:
    assert_same_params(trained(2, "tp2"), single_process_reference)


# The four-process runs share one launch, so each test's other torch path or other layout
# costs a few toy steps, not a launch: `make test` runs them all.
@pytest.mark.parametrize("paths", [("private",), ("private", "public")], ids=["private", "both"])
def test_dp2_x_tp2_matches_dp1_with_the_same_bits_on_both_torch_paths(
    trained: Any, single_process_reference: dict[str, Tensor], paths: tuple[str, ...]
) -> None:
    # The public path normalizes and clips the DTensor gradients' local shards one by one.
    params = {path: trained(4, f"dp2_tp2-{path}") for path in paths}
    assert_same_params(params["private"], single_process_reference)
    for name, private in params["private"].items():
        for path in paths[1:]:
            assert torch.equal(private, params[path][name]), name


@pytest.mark.parametrize("with_ddp", [False, True])
def test_hsdp_2x2_matches_ddp_on_4_and_dp1(
    trained: Any, single_process_reference: dict[str, Tensor], with_ddp: bool
) -> None:
    assert_same_params(trained(4, "hsdp2x2"), single_process_reference)
    if with_ddp:
        assert_same_params(trained(4, "ddp4"), single_process_reference)


@pytest.mark.parametrize("torch_path", ["public", "private"])
def test_fsdp_over_the_whole_dp_gang_of_an_hsdp_layout_matches_dp1(
    trained: Any, single_process_reference: dict[str, Tensor], torch_path: str
) -> None:
    # kind="fsdp" shards over Gangs.dp_mesh: HSDP's dims flattened on the private path, a mesh
    # of the DP gang's public process group on the public one.
    params = trained(4, f"fsdp_over_hsdp-{torch_path}")
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
    out: Path,
) -> list[tuple[list[dict[str, int]], list[dict[str, int]]]]:
    """Each rank's collectives on the root gang: of the steps that do not publish (1, 2, 4, 5),
    and of those that do (3, 6), with their publish."""
    per_rank = []
    for per_step in rank_reports(out, 2):
        assert len(per_step) == 6
        publishing = [per_step[2], per_step[5]]
        per_rank.append(([c for i, c in enumerate(per_step) if i not in (2, 5)], publishing))
    return per_rank


def _count_collectives(out: Path, *kinds: str) -> Path:
    assert_ok(torchrun(2, "tests/workers/collective_count.py", str(out), ",".join(kinds)))
    return out


@pytest.fixture(scope="module")
def collectives(two_rank_checks: Path) -> Path:
    """The counts of a DDP run and of an FSDP2 run, made in the shared two-rank launch
    (tests/workers/two_rank_checks.py): ``OUT/KIND/rank_R.json``."""
    return two_rank_checks / "collectives"


def test_a_ddp_step_makes_one_collective_beside_ddps_own_and_does_not_wait_for_it(
    collectives: Path,
) -> None:
    for steps, publishes in _collectives_per_step(collectives / "ddp"):
        # DDP reduces the gradients on its own process group; the step's counts take one
        # all-reduce of their own, started before the last backward; no blocking one.
        assert steps == [{"all_reduce_async": 1}] * 4
        # A publish checks for non-finite values and gathers the peak memory.
        assert publishes == [{"all_reduce_async": 1, "all_reduce": 2}] * 2


@pytest.mark.slow
def test_accumulated_micro_batches_leave_ddps_gradients_unreduced_until_the_last(
    tmp_path: Path,
) -> None:
    out = _count_collectives(tmp_path, "ddp-hooked") / "ddp-hooked"
    for steps, _ in _collectives_per_step(out):
        # The toy model's gradients fit one bucket: one all-reduce of it a step, not one per
        # micro-batch.
        assert steps == [{"ddp_bucket": 1, "all_reduce_async": 1}] * 4


def test_an_fsdp_step_makes_one_collective_of_its_own_and_does_not_wait_for_it(
    collectives: Path,
) -> None:
    for steps, publishes in _collectives_per_step(collectives / "fsdp"):
        # One all-reduce of the counts starts before the last backward; no blocking one.
        assert steps == [{"all_reduce_async": 1}] * 4
        assert publishes == [{"all_reduce_async": 1, "all_reduce": 2}] * 2
