"""``apply_data_parallel``: DDP's options reach DDP, and are refused for FSDP2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch import nn

from gangs import Gangs
from runtime import apply_data_parallel
from tests.conftest import rank_reports

WORKER = "tests/workers/ddp_options.py"


# The cases of ddp_options.py, run in the shared two-rank launch (tests/workers/two_rank_checks.py)
# after every other check: the case DDP refuses leaves its reducer mid-iteration.
DDP_CASES: dict[str, dict[str, Any]] = {
    "options": {"find_unused_parameters": True, "gradient_as_bucket_view": True},
    "sparse_by_hand": {"sparse_by_hand": True},
    "no_options": {},
}


@pytest.fixture(scope="module")
def ddp_cases(two_rank_checks: Path) -> Path:
    """Each case's reports, ``OUT/CASE/rank_R.json``."""
    return two_rank_checks / "ddp_options"


@pytest.mark.distributed
def test_ddp_options_reach_ddp_and_ranks_draw_their_own_numbers(ddp_cases: Path) -> None:
    first, second = rank_reports(ddp_cases / "options", 2)
    for report in (first, second):
        assert report["find_unused_parameters"] is True
        assert report["gradient_as_bucket_view"] is True
        assert report["static_graph"] is False
    # Seeded per DP rank: Python's and NumPy's generators draw differently on each.
    assert first["python"] != second["python"]
    assert first["numpy"] != second["numpy"]


@pytest.mark.distributed
def test_without_find_unused_parameters_ddp_refuses_an_unused_layer(ddp_cases: Path) -> None:
    for report in rank_reports(ddp_cases / "no_options", 2):
        assert "find_unused_parameters" in report.get("error", ""), report


@pytest.mark.distributed
def test_a_sparse_embedding_reduced_by_a_hand_made_ddp_is_refused(ddp_cases: Path) -> None:
    for message in rank_reports(ddp_cases / "sparse_by_hand", 2):
        assert message is not None, "the sparse gradients DDP reduces were not refused"
        assert "reduces the sparse gradients of weight" in message
        assert "runtime.apply_data_parallel" in message


def test_ddp_options_are_refused_for_fsdp() -> None:
    with pytest.raises(ValueError, match="find_unused_parameters, static_graph are DDP options"):
        apply_data_parallel(
            nn.Linear(2, 2),
            Gangs.single(),
            kind="fsdp",
            find_unused_parameters=True,
            static_graph=True,
        )


def test_sparse_embeddings_leave_ddp_only_through_the_private_setter(
    monkeypatch: pytest.MonkeyPatch, torch_private_apis: str
) -> None:
    # No public API makes DDP ignore a parameter: off the tested torch versions a sparse
    # embedding under DDP is refused before DDP is made, naming the reason.
    from gangs.torch_versions import PRIVATE_APIS_ENV_VAR
    from runtime.parallel.wrapping import _leave_sparse_out_of_ddp

    model = nn.Sequential(nn.Embedding(5, 2, sparse=True), nn.Linear(2, 2))
    if torch_private_apis == "private":
        _leave_sparse_out_of_ddp(model, Gangs.single())
        assert model[0].weight._ddp_ignored
        return
    monkeypatch.setattr("torch.__version__", "2.15.0")
    with pytest.raises(
        ValueError, match=r"sparse embeddings 0\.weight out only through a private"
    ) as ex:
        _leave_sparse_out_of_ddp(model, Gangs.single())
    assert f"this is torch 2.15.0, or {PRIVATE_APIS_ENV_VAR} is 'public'" in str(ex.value)
    assert not hasattr(model[0].weight, "_ddp_ignored")


def test_experts_leave_ddp_through_the_private_setter_or_are_refused_toward_fsdp2(
    monkeypatch: pytest.MonkeyPatch, torch_private_apis: str
) -> None:
    # Expert-parallel experts: DDP ignores them on the private path; on the public one a run
    # is pointed to FSDP2, whose public ignored_params leaves them out.
    from runtime.parallel.wrapping import _leave_sparse_out_of_ddp

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    experts = [model[1].weight]
    if torch_private_apis == "private":
        _leave_sparse_out_of_ddp(model, Gangs.single(), experts)
        assert model[1].weight._ddp_ignored
        assert not hasattr(model[0].weight, "_ddp_ignored")
        return
    monkeypatch.setattr("torch.__version__", "2.15.0")
    with pytest.raises(ValueError, match=r"experts out only through a private.*data_parallel=fsdp"):
        _leave_sparse_out_of_ddp(model, Gangs.single(), experts)
    assert not hasattr(model[1].weight, "_ddp_ignored")
