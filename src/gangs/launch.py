"""Start-up agreement between the ranks of one ``torchrun`` launch, before any process group.

A rank that refuses to start (its output directory is in use, its config file is unreadable) exits
before it joins the default process group. The others would wait for it inside the group's
rendezvous, in C++, where Python cannot run a signal handler: they would ignore torchrun's
SIGTERM until it kills them. So the ranks first meet at a :class:`LaunchBarrier` in torchrun's
own key-value store, which outlives every worker: a rank that fails posts its reason there and
exits, and the others read the reason within a fraction of a second and exit with it too.
"""

from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta
from typing import Final, final

from torch.distributed import Store, TCPStore  # type: ignore[attr-defined]

from gangs.gang import GangError

_POLL_INTERVAL: Final = 0.05
"""Seconds between two looks at the store; Python runs signal handlers between them."""


class LaunchRefused(Exception):
    """Another rank of the launch failed during start-up; :attr:`reason` says which and why,
    :attr:`cause` why in that rank's own words."""

    def __init__(self, cause: str, exit_code: int, rank: int) -> None:
        self.reason = f"rank {rank}: {cause}"
        super().__init__(self.reason)
        self.cause = cause
        self.exit_code = exit_code
        self.rank = rank


@final
class LaunchBarrier:
    """Where the ranks of a launch wait for each other, or learn why one of them failed.

    Made by :meth:`from_environment` under ``torchrun`` (which hosts the store); a single
    process or a launch without torchrun's store has none, and needs none: there is no peer to
    wait for, or nothing that outlives rank 0 to tell the others.
    """

    def __init__(self, store: Store, *, rank: int, world_size: int, key_prefix: str) -> None:
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._key_prefix = key_prefix
        self._failed_key = f"{key_prefix}/failed"

    @staticmethod
    def from_environment(timeout: timedelta = timedelta(minutes=15)) -> LaunchBarrier | None:
        """The barrier of this torchrun launch, or ``None`` outside torchrun or alone."""
        env = os.environ
        world_size = int(env.get("WORLD_SIZE", "1"))
        if world_size == 1 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return None
        try:
            store = TCPStore(
                env["MASTER_ADDR"],
                int(env["MASTER_PORT"]),
                world_size,
                is_master=False,
                timeout=timeout,
            )
        except (KeyError, ValueError, RuntimeError) as ex:
            raise GangError(f"torchrun's store cannot be reached: {ex}") from ex
        # The agent keeps its store across restarts of the workers: one namespace per attempt.
        attempt = (
            f"{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        )
        return LaunchBarrier(
            store,
            rank=int(env["RANK"]),
            world_size=world_size,
            key_prefix=f"trainkit/launch/{attempt}",
        )

    def fail(self, reason: str, *, exit_code: int) -> None:
        """Tell the other ranks that this one cannot start, and why (the first reason stays)."""
        value = f"{exit_code}|{self._rank}|{reason}"
        # When the launcher is gone, its store is too; the watchdog then ends the other ranks.
        with contextlib.suppress(RuntimeError):
            self._store.compare_set(self._failed_key, "", value)

    def failure(self) -> LaunchRefused | None:
        """What another rank posted with :meth:`fail`, if anything."""
        try:
            if not self._store.check([self._failed_key]):
                return None
            exit_code, rank, cause = self._store.get(self._failed_key).decode().split("|", 2)
        except RuntimeError:
            return None
        return LaunchRefused(cause, int(exit_code), int(rank))

    def wait(self, stage: str, timeout: timedelta) -> None:
        """Return once every rank arrived at ``stage``; raise :class:`LaunchRefused` once one
        failed. Waits in short slices, so that a stop signal is handled here at once."""
        arrived = f"{self._key_prefix}/{stage}/arrived/"
        self._store.set(f"{arrived}{self._rank}", "1")
        keys = [f"{arrived}{rank}" for rank in range(self._world_size)]
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            failure = self.failure()
            if failure is not None:
                raise failure
            if self._store.check(keys):
                return
            if time.monotonic() > deadline:
                missing = [r for r, key in enumerate(keys) if not self._store.check([key])]
                raise GangError(
                    f"Ranks {missing} did not reach '{stage}' within {timeout}: they are stuck "
                    "there, or were launched with another --nnodes or --nproc-per-node."
                )
            time.sleep(_POLL_INTERVAL)
