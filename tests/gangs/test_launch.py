"""The launch barrier over a real TCPStore in this process, one barrier object per rank."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from gangs import GangError, LaunchBarrier, LaunchRefused
from tests.conftest import free_port


def barriers(world_size: int) -> list[LaunchBarrier]:
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    return [
        LaunchBarrier(store, rank=rank, world_size=world_size, key_prefix="test")
        for rank in range(world_size)
    ]


def test_the_last_rank_to_arrive_releases_the_barrier() -> None:
    first, second = barriers(2)
    with pytest.raises(GangError, match=r"Ranks \[1\] did not reach 'recipe'"):
        first.wait("recipe", timedelta(seconds=0.2))
    second.wait("recipe", timedelta(seconds=1))
    first.wait("recipe", timedelta(seconds=1))


def test_a_failure_reaches_the_waiting_ranks_with_its_reason_and_status() -> None:
    first, second = barriers(2)
    assert first.failure() is None
    second.fail("the directory is in use.", exit_code=2)
    second.fail("a later, secondary failure.", exit_code=1)  # the first reason stays
    with pytest.raises(LaunchRefused) as caught:
        first.wait("recipe", timedelta(seconds=5))
    assert caught.value.reason == "rank 1: the directory is in use."
    assert (caught.value.cause, caught.value.rank) == ("the directory is in use.", 1)
    assert caught.value.exit_code == 2


def test_stages_are_separate_barriers() -> None:
    first, second = barriers(2)
    waiting = threading.Thread(target=first.wait, args=("a", timedelta(seconds=5)))
    waiting.start()
    second.wait("a", timedelta(seconds=5))
    waiting.join()
    with pytest.raises(GangError, match=r"Ranks \[1\] did not reach 'b'"):
        first.wait("b", timedelta(seconds=0.2))


def test_no_barrier_for_one_process_or_outside_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert LaunchBarrier.from_environment() is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert LaunchBarrier.from_environment() is None
