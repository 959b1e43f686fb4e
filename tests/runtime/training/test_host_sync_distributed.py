"""No host-device synchronization in a steady step under DDP, FSDP2 and TP, in real torchrun
processes (``pytest -k host_sync``): the one-process features of ``test_host_sync.py``, on every
rank; ``make test``'s layouts all in one launch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import assert_ok, rank_reports, torchrun
from tests.sync_detector import FEATURES, assert_as_pinned

pytestmark = pytest.mark.distributed

LAYOUTS = {
    # name: (processes, data parallelism, TP size)
    "ddp": (2, "ddp", 1),
    "fsdp2": (2, "fsdp", 1),
    "tp": (2, "ddp", 2),
    "fsdp2_x_tp": (4, "fsdp", 2),
}


def _slow(name: str, path: str) -> bool:
    # make test: each layout of two processes on torch's private APIs (test_host_sync watches
    # the public fallbacks in one process); make test-all: the rest.
    return LAYOUTS[name][0] > 2 or path == "public"


# make test's layouts, watched in the shared two-rank launch (tests/workers/two_rank_checks.py).
FAST = ("ddp", "fsdp2", "tp")
FAST_PATHS = {(name, "private") for name in FAST}
FAST_LAYOUTS = {f"{name}-private": (*LAYOUTS[name][1:], "private") for name in FAST}


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, ...], Path]:
    """The output directory of each launch made so far, by the layout ids it watched."""
    return {}


def watch(
    launches: dict[tuple[str, ...], Path],
    tmp_path_factory: pytest.TempPathFactory,
    layouts: tuple[tuple[str, str], ...],
) -> Path:
    """One launch that watches ``layouts`` (their (name, path) pairs, one world size), once."""
    ids = tuple(f"{name}-{path}" for name, path in layouts)
    if ids not in launches:
        out = tmp_path_factory.mktemp("host_sync")
        nproc = LAYOUTS[layouts[0][0]][0]
        cases = {f"{name}-{path}": [*LAYOUTS[name][1:], path] for name, path in layouts}
        worker = "tests/workers/host_sync.py"
        assert_ok(torchrun(nproc, worker, str(out), "--layouts", json.dumps(cases)))
        launches[ids] = out
    return launches[ids]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(
            (name, path),
            id=name if path == "private" else f"{name}-public",
            marks=[pytest.mark.slow] if _slow(name, path) else [],
        )
        for name in LAYOUTS
        for path in ("private", "public")
    ],
)
def syncs_by_rank(
    request: pytest.FixtureRequest,
    launches: dict[tuple[str, ...], Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> list[dict[str, Any]]:
    """Each rank's syncs in the steady steps of each feature, under the layout of the param and
    on its torch path. make test's layouts come from the shared two-rank launch; make
    test-all's others launch alone."""
    name, path = request.param
    if (name, path) in FAST_PATHS:
        out = request.getfixturevalue("two_rank_checks") / "host_sync"
    else:
        out = watch(launches, tmp_path_factory, ((name, path),))
    reports: list[dict[str, Any]] = rank_reports(out / f"{name}-{path}", LAYOUTS[name][0])
    return reports


@pytest.mark.parametrize("feature", FEATURES)
def test_a_distributed_steady_step_host_syncs_only_where_pinned(
    syncs_by_rank: list[dict[str, Any]], feature: str
) -> None:
    # The counts of one process: the reads that decide a step are of values every rank holds
    # alike (the reduced gradients' norm) or of its own losses, whatever the layout, and the
    # collectives of DDP, FSDP2 and DTensor wait for nothing on the host.
    for syncs in syncs_by_rank:
        assert_as_pinned(feature, syncs[feature])
