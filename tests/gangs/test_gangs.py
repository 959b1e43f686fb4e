"""Gangs under real torchrun at world sizes 1, 2 and 4, and their errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gangs import (
    FakeGang,
    GangError,
    Gangs,
    GangSizeError,
    ProcessGroupGang,
    ReduceOperation,
    is_collective_timeout,
    setup_gangs,
    setup_parallel_gangs,
)
from tests.conftest import RunTorch, assert_ok, torchrun

WORKER = "tests/workers/gang_check.py"


def run_gang_check(
    run_torchrun: RunTorch, tmp_path: Path, nproc: int, tp_size: int, *extra: str
) -> list[dict[str, Any]]:
    assert_ok(run_torchrun(nproc, WORKER, str(tmp_path), str(tp_size), *extra))
    return [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.distributed
def test_world_of_one_is_fake(run_torchrun: RunTorch, tmp_path: Path) -> None:
    (report,) = run_gang_check(run_torchrun, tmp_path, 1, 1)
    assert report["root"] == [0, 1]
    assert report["dp_fake"] and report["tp_fake"]
    assert report["root_sum"] == 1.0
    assert report["root_members"] == [0.0]
    assert report["mesh"] is None
    assert report["make_gang_single"] == [0, 1]
    assert "[1]" in report["bad_ranks_error"]


@pytest.mark.distributed
def test_two_processes_data_parallel(run_torchrun: RunTorch, tmp_path: Path) -> None:
    reports = run_gang_check(run_torchrun, tmp_path, 2, 1)
    for rank, report in enumerate(reports):
        assert report["root"] == [rank, 2]
        assert report["dp"] == [rank, 2]
        assert report["tp_fake"]
        # values are rank + 1: 1 and 2
        assert report["root_sum"] == 3.0
        assert report["root_mean"] == 1.5
        assert report["root_product"] == 2.0
        assert report["root_min"] == 1.0
        assert report["root_max"] == 2.0
        assert report["root_members"] == [0.0, 1.0]
        assert report["root_members_list"] == [0.0, 1.0]
        assert report["root_objects"] == [{"rank": 0}, {"rank": 1}]
        assert report["broadcast_from_last"] == 1.0
        assert report["broadcast_objects"] == ["hello from 0", 0]
        assert report["mesh"] == [["dp", "tp"], [[0], [1]]]
        # Every group behind a gang or a mesh dim has the gang's timeout, not torch's default.
        assert report["timeouts"] and set(report["timeouts"]) == {14 * 60.0}
    assert reports[0]["make_gang_single"] == [0, 1]
    assert reports[1]["make_gang_single"] is None


@pytest.mark.distributed
# `make test` checks the same DP and TP members under an HSDP x TP layout, below.
@pytest.mark.slow
def test_four_processes_dp_x_tp_layout(run_torchrun: RunTorch, tmp_path: Path) -> None:
    reports = run_gang_check(run_torchrun, tmp_path, 4, 2)
    for rank, report in enumerate(reports):
        dp_rank, tp_rank = divmod(rank, 2)
        assert report["dp"] == [dp_rank, 2]
        assert report["tp"] == [tp_rank, 2]
        # TP gangs are consecutive ranks, DP gangs stride across them.
        tp_members = [float(dp_rank * 2 + t) for t in range(2)]
        dp_members = [float(d * 2 + tp_rank) for d in range(2)]
        assert report["tp_members"] == tp_members
        assert report["dp_members"] == dp_members
        assert report["tp_sum"] == sum(tp_members) + 2
        assert report["dp_sum"] == sum(dp_members) + 2
        assert report["root_sum"] == 10.0
        assert report["mesh"] == [["dp", "tp"], [[0, 1], [2, 3]]]


@pytest.fixture(scope="module")
def four_process_layouts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch of four processes for the HSDP and HSDP x TP layouts, each on both torch
    paths (gangs.torch_versions): ``OUT/LAYOUT-PATH/rank_R.json``."""
    out = tmp_path_factory.mktemp("four_processes")
    cases: dict[str, tuple[Any, ...]] = {
        f"{layout}-{path}": (tp_size, 2, path)
        for layout, tp_size in (("hsdp", 1), ("hsdp_tp", 2))
        for path in ("private", "public")
    }
    # Expert parallelism over 4 DP ranks, and over the 2 DP ranks beside TP.
    cases |= {"ep": (1, None, None, 2), "ep_tp": (2, None, None, 2)}
    # Expert parallelism over the 2 DP ranks of each of 2 pipeline stages.
    cases |= {"pp_ep": (1, None, None, 2, 1, 2)}
    # Sequence parallelism beside DP, and beside TP.
    cases |= {"sp": (1, None, None, 1, 2), "sp_tp": (2, None, None, 1, 2)}
    assert_ok(torchrun(4, WORKER, str(out), "--cases", json.dumps(cases)))
    return out


def four_process_reports(out: Path, case: str) -> list[dict[str, Any]]:
    return [json.loads((out / case / f"rank_{r}.json").read_text()) for r in range(4)]


@pytest.mark.distributed
@pytest.mark.parametrize("torch_path", ["private", "public"])
def test_four_processes_hsdp_layout_keeps_the_whole_dp_gang(
    four_process_layouts: Path, torch_path: str
) -> None:
    reports = four_process_reports(four_process_layouts, f"hsdp-{torch_path}")
    for rank, report in enumerate(reports):
        # Data sharding, metrics and normalization still see all 4 DP ranks.
        assert report["dp"] == [rank, 4]
        assert report["dp_members"] == [0.0, 1.0, 2.0, 3.0]
        assert report["tp_fake"]
        assert report["mesh"] == [["dp_replicate", "dp_shard", "tp"], [[[0], [1]], [[2], [3]]]]
        assert report["dp_shard_size"] == 2
        # Shard groups are consecutive ranks (a node); replicas stride across them.
        assert report["hsdp_mesh"] == [[0, 1], [2, 3]]
        assert report["dp_mesh"] == [0, 1, 2, 3]


@pytest.mark.distributed
@pytest.mark.parametrize("torch_path", ["private", "public"])
def test_four_processes_hsdp_x_tp_layout_on_each_torch_path(
    four_process_layouts: Path, torch_path: str
) -> None:
    reports = four_process_reports(four_process_layouts, f"hsdp_tp-{torch_path}")
    for rank, report in enumerate(reports):
        dp_rank, tp_rank = divmod(rank, 2)
        assert report["dp"] == [dp_rank, 2]
        assert report["dp_members"] == [float(tp_rank), float(2 + tp_rank)]
        assert report["tp_members"] == [float(dp_rank * 2), float(dp_rank * 2 + 1)]
        assert report["hsdp_mesh"] == [[tp_rank, 2 + tp_rank]]
        if torch_path == "private":
            assert report["dp_mesh"] == [tp_rank, 2 + tp_rank]
        else:
            # No public mesh of the whole DP gang shares a root with the TP mesh (FSDP2 needs it).
            assert "dp_mesh" not in report
            assert "Use kind='hsdp'" in report["dp_mesh_error"]
            assert "TRAINKIT_TORCH_PRIVATE_APIS is 'public'" in report["dp_mesh_error"]


@pytest.mark.distributed
def test_four_processes_ep_gangs_are_consecutive_dp_ranks_and_replicas_stride(
    four_process_layouts: Path,
) -> None:
    for rank, report in enumerate(four_process_reports(four_process_layouts, "ep")):
        start = rank - rank % 2
        assert report["ep_members"] == [float(start), float(start + 1)]
        assert report["ep_replicas_members"] == [float(rank % 2), float(rank % 2 + 2)]
        assert report["ep_mesh"] == [start, start + 1]
        # One mesh holds both: FSDP2 shards the experts over ep_replicate beside ep.
        assert report["expert_mesh"] == [["ep_replicate", "ep", "tp"], [[[0], [1]], [[2], [3]]]]
        assert report["dp_members"] == [0.0, 1.0, 2.0, 3.0]
    for rank, report in enumerate(four_process_reports(four_process_layouts, "ep_tp")):
        # DP ranks stride over TP (rank = dp_rank * 2 + tp_rank); EP takes both DP ranks.
        assert report["ep_members"] == [float(rank % 2), float(rank % 2 + 2)]
        assert "ep_replicas_members" in report and len(report["ep_replicas_members"]) == 1
        assert report["expert_mesh"] == [["ep_replicate", "ep", "tp"], [[[0, 1], [2, 3]]]]


@pytest.mark.distributed
def test_four_processes_each_pipeline_stage_splits_its_own_experts(
    four_process_layouts: Path,
) -> None:
    for rank, report in enumerate(four_process_reports(four_process_layouts, "pp_ep")):
        start = rank - rank % 2  # the stage's first rank
        assert report["dp_members"] == [float(start), float(start + 1)]
        assert report["ep_members"] == [float(start), float(start + 1)]
        assert report["ep_replicas_members"] == [float(rank)]
        assert report["ep_mesh"] == [start, start + 1]
        assert report["expert_mesh"] == [
            ["pp", "ep_replicate", "ep", "tp"],
            [[[[0], [1]]], [[[2], [3]]]],
        ]


@pytest.mark.distributed
def test_four_processes_sp_gangs_are_consecutive_and_gradients_add_over_dp_x_sp(
    four_process_layouts: Path,
) -> None:
    for rank, report in enumerate(four_process_reports(four_process_layouts, "sp")):
        start = rank - rank % 2
        assert report["mesh"] == [["dp", "sp", "tp"], [[[0], [1]], [[2], [3]]]]
        assert report["sp_members"] == [float(start), float(start + 1)]
        # The DP gang counts data shards: the SP ranks of one share a DP rank.
        assert report["dp_members"] == [float(rank % 2), float(rank % 2 + 2)]
        assert report["dp"] == [rank // 2, 2]
        assert report["dp_sp_members"] == [0.0, 1.0, 2.0, 3.0]
        assert report["dp_sp_mesh"] == [0, 1, 2, 3]
        assert set(report["sp_timeouts"]) == {14 * 60.0}
    for rank, report in enumerate(four_process_reports(four_process_layouts, "sp_tp")):
        # rank = (dp_rank * sp_size + sp_rank) * tp_size + tp_rank, with one DP rank
        assert report["mesh"] == [["dp", "sp", "tp"], [[[0, 1], [2, 3]]]]
        assert report["tp_members"] == [float(rank - rank % 2), float(rank - rank % 2 + 1)]
        assert report["sp_members"] == [float(rank % 2), float(rank % 2 + 2)]
        assert report["dp"] == [0, 1]
        assert report["dp_sp_members"] == report["sp_members"]
        # FSDP2's dp_sp dim and TP's dim are cut from one mesh.
        assert report["dp_sp_mesh"] == [rank % 2, rank % 2 + 2]
        assert report["tp_mesh"] == [rank - rank % 2, rank - rank % 2 + 1]


def test_sp_size_must_divide_the_processes_and_compose() -> None:
    from gangs.setup import _check_sizes

    with pytest.raises(
        GangError,
        match=r"^sp_size is 2, but must divide the processes over TP \(1 = 1 processes / "
        r"tp_size 1\)\. Use one of 1\.$",
    ):
        setup_parallel_gangs(FakeGang(), sp_size=2)
    single = Gangs.single()
    assert single.sp.size == 1 and single.dp_sp is single.dp
    # Experts split over the ranks with different tokens: DP x SP.
    assert _check_sizes(4, tp_size=1, sp_size=2, ep_size=4, dp_shard_size=None) == 2
    with pytest.raises(
        GangError,
        match=r"^ep_size is 3, but must divide the DP x SP size \(4 = 4 processes / tp_size 1\)",
    ):
        _check_sizes(4, tp_size=1, sp_size=2, ep_size=3, dp_shard_size=None)
    with pytest.raises(GangError, match=r"^sp_size 2 does not compose with dp_shard_size 2"):
        setup_parallel_gangs(FakeGang(), sp_size=2, dp_shard_size=2)


def test_pipeline_stages_split_their_own_experts_but_not_sequences_yet() -> None:
    from gangs.setup import _check_sizes

    assert _check_sizes(8, tp_size=2, sp_size=1, ep_size=1, dp_shard_size=2, pp_size=2) == 2
    assert _check_sizes(8, tp_size=1, sp_size=1, ep_size=4, dp_shard_size=None, pp_size=2) == 4
    with pytest.raises(
        GangSizeError,
        match=r"^ep_size is 8, but must divide the DP size \(4 = 4 processes of a stage / ",
    ):
        _check_sizes(8, tp_size=1, sp_size=1, ep_size=8, dp_shard_size=None, pp_size=2)
    with pytest.raises(
        GangSizeError, match=r"^pp_size \(2\) and sp_size \(2\) do not compose yet"
    ) as info:
        _check_sizes(8, tp_size=1, sp_size=2, ep_size=1, dp_shard_size=None, pp_size=2)
    assert info.value.naming({"pp_size": "gang.pp_size"}).startswith("gang.pp_size (2)")


def test_ep_size_must_divide_the_dp_size() -> None:
    with pytest.raises(
        GangError, match=r"ep_size is 2, but must divide the DP size \(1 = .*\)\. Use one of 1\."
    ):
        setup_parallel_gangs(FakeGang(), ep_size=2)
    assert Gangs.single().ep.size == 1
    assert Gangs.single().ep_replicas.size == 1


def test_dp_shard_size_must_divide_the_dp_size() -> None:
    with pytest.raises(
        GangError,
        match=r"^dp_shard_size is 3, but must divide the DP size \(1 = 1 processes / tp_size 1\)\. "
        r"Use one of 1\.$",
    ):
        setup_parallel_gangs(FakeGang(), dp_shard_size=3)


def test_hsdp_mesh_without_dp_shard_size_is_a_clear_error() -> None:
    with pytest.raises(GangError, match="Pass dp_shard_size to setup_gangs"):
        _ = Gangs.single().hsdp_mesh


def test_fake_gang_collectives_are_identity() -> None:
    gang = FakeGang()
    tensor = torch.tensor([3.0])
    for op in ReduceOperation:
        gang.all_reduce(tensor, op)
    assert tensor.item() == 3.0
    out = torch.zeros(1, 1)
    gang.all_gather(out, tensor)
    assert out.tolist() == [[3.0]]
    assert gang.all_gather_objects("x") == ["x"]
    assert gang.make_gang([0]) is gang


def test_fake_gang_has_no_process_group() -> None:
    with pytest.raises(GangError, match="torchrun"):
        FakeGang().as_process_group()


def test_tp_size_must_divide_world() -> None:
    fake = FakeGang()
    with pytest.raises(
        GangError, match=r"tp_size is 2, but must divide the number of processes \(1\)\. Use one"
    ):
        setup_parallel_gangs(fake, tp_size=2)
    with pytest.raises(GangError, match=r"tp_size is 0, but must divide"):
        setup_parallel_gangs(fake, tp_size=0)


def test_single_process_setup_has_no_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    gangs = setup_gangs()
    assert isinstance(gangs.root, FakeGang)
    with pytest.raises(GangError, match="force_process_group=True to setup_gangs for FSDP2"):
        _ = gangs.device_mesh


def test_one_process_asked_for_a_process_group_gets_a_mesh_of_one(
    gangs_with_mesh_of_one: Gangs,
) -> None:
    """What FSDP2 shards over on one process: a gloo group of this rank and a mesh of size 1;
    the DP and TP gangs stay fake, so no step pays for a collective of one."""
    import torch.distributed as dist

    gangs = gangs_with_mesh_of_one
    assert isinstance(gangs.root, ProcessGroupGang) and gangs.root.size == 1
    assert dist.get_backend(gangs.root.as_process_group()) == "gloo"
    assert isinstance(gangs.dp, FakeGang) and isinstance(gangs.tp, FakeGang)
    assert gangs.device_mesh.mesh_dim_names == ("dp", "tp")
    assert gangs.device_mesh.mesh.tolist() == [[0]]
    assert (gangs.dp_mesh.size(), gangs.tp_mesh.size()) == (1, 1)
    tensor = torch.tensor([3.0])
    gangs.root.all_reduce(tensor, ReduceOperation.SUM)
    assert tensor.item() == 3.0
    assert gangs.root.all_gather_objects("x") == ["x"]


@pytest.mark.parametrize("private", ["private", "public"])
def test_hsdp_on_one_process_has_both_dp_meshes(
    monkeypatch: pytest.MonkeyPatch, private: str
) -> None:
    import torch.distributed as dist

    from gangs.torch_versions import PRIVATE_APIS_ENV_VAR

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv(PRIVATE_APIS_ENV_VAR, private)
    gangs = setup_gangs(device=torch.device("cpu"), dp_shard_size=1, force_process_group=True)
    try:
        assert gangs.dp_shard_size == 1
        assert gangs.hsdp_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
        assert gangs.dp_mesh.size() == 1
    finally:
        gangs.root.close()
    assert not dist.is_initialized()


def test_a_forced_process_group_is_destroyed_when_its_gangs_cannot_be_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(GangError, match=r"tp_size is 2, but must divide the number of processes"):
        setup_gangs(device=torch.device("cpu"), tp_size=2, force_process_group=True)
    assert not dist.is_initialized()


def test_bad_world_size_env_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(GangError, match="WORLD_SIZE must be an integer, but is 'two'"):
        setup_gangs()


@pytest.mark.parametrize(
    ("error", "timeout"),
    [
        (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Read error: Timed out"), True),
        # gloo, when the timeout struck another operation on the same connection first.
        (RuntimeError("Application timeout caused pair closure"), True),
        (RuntimeError("Watchdog caught collective operation timeout: WorkNCCL timed out"), True),
        (RuntimeError("Connection reset by peer"), False),
        (ValueError("timed out"), False),
    ],
)
def test_collective_timeouts_are_told_from_other_errors(error: Exception, timeout: bool) -> None:
    assert is_collective_timeout(error) is timeout
