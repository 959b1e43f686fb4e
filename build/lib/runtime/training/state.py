"""Where the training is, why it stopped, and the per-rank trainer state a checkpoint holds.

A checkpoint's ``trainer/rank_R.pt`` is one mapping with a fixed set of sections, each owned by
the part of the Trainer that reads and writes it::

    version        TRAINER_STATE_VERSION
    train_state    TrainState: step, data epoch, stop reason
    data_reader    the reader's position
    rng            the random number generators
    train_step     loss scale and LR scheduler
    train_metrics  the unpublished metric window and the unit's metrics
    validation     last and best scores, early stopper
    stateful       (only when there are any) the stateful callbacks and registered objects

The ``stateful`` section holds each :class:`Stateful` object by its name (:func:`save_stateful`,
:func:`load_stateful`). The format is version 3 (``TRAINER_STATE_VERSION``); a checkpoint of any
other version is a clear error (:func:`check_trainer_state`). A change to the sections or to what
one holds bumps the version.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from enum import Enum
from typing import Any, Final, Protocol, final, runtime_checkable

from checkpoint import CheckpointError
from checkpoint.state_keys import check_state_keys

log = logging.getLogger(__name__)

TRAINER_STATE_VERSION: Final = 3

TRAINER_STATE_SECTIONS: Final = frozenset(
    {
        "version",
        "train_state",
        "data_reader",
        "rng",
        "train_step",
        "train_metrics",
        "validation",
    }
)

STATEFUL_SECTION: Final = "stateful"
"""The optional section: absent in a checkpoint of a run without stateful callbacks."""


@runtime_checkable
class Stateful(Protocol):
    """Something whose state a checkpoint keeps, such as
    :class:`~runtime.training.early_stop.PatienceEarlyStopper`."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StopReason(Enum):
    """Why the training loop stopped; all but a preemption end the run, which pauses it."""

    MAX_NUM_STEPS = "max_num_steps"
    MAX_NUM_DATA_EPOCHS = "max_num_data_epochs"
    EARLY_STOP = "early_stop"
    END_OF_DATA = "end_of_data"
    """The data reader has no data epoch after the last (``DataReader.has_next_epoch``): a
    stream of windows ended. A relaunch trains on if the stream has gone on since."""
    PREEMPTED = "preempted"

    @property
    def ends_the_run(self) -> bool:
        return self is not StopReason.PREEMPTED

    @property
    def is_limit(self) -> bool:
        """A limit a relaunch with larger values lifts (an early stop is final)."""
        return self in (StopReason.MAX_NUM_STEPS, StopReason.MAX_NUM_DATA_EPOCHS)


@final
class TrainState:
    """The step last taken, the data epoch being read, and the reason the loop stopped (if it has)."""

    def __init__(self) -> None:
        self.step_nr = 0
        self.data_epoch_nr = 1
        self.stop_reason: StopReason | None = None

    @property
    def finished(self) -> bool:
        """Whether the run is over (a preempted run is not: it resumes)."""
        return self.stop_reason is not None and self.stop_reason.ends_the_run

    def state_dict(self) -> dict[str, Any]:
        # A preemption is stored as "not stopped": the relaunch goes on from here.
        reason = self.stop_reason if self.finished else None
        return {
            "step_nr": self.step_nr,
            "data_epoch_nr": self.data_epoch_nr,
            "stop_reason": None if reason is None else reason.value,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_keys(state, {"step_nr", "data_epoch_nr", "stop_reason"}, what="train_state")
        self.step_nr = int(state["step_nr"])
        self.data_epoch_nr = int(state["data_epoch_nr"])
        reason = state["stop_reason"]
        try:
            self.stop_reason = None if reason is None else StopReason(reason)
        except ValueError:
            raise CheckpointError(
                f"The trainer state has the stop reason {reason!r}, but this version knows only "
                f"{', '.join(repr(r.value) for r in StopReason)}. Resume with the version of the "
                "runtime that saved the checkpoint."
            ) from None


def check_trainer_state(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state`` if it is a trainer state of the current format; CheckpointError if not."""
    version = state.get("version")
    if version != TRAINER_STATE_VERSION:
        raise CheckpointError(
            f"The trainer state of the checkpoint has format version {version}, but this version "
            f"of the runtime reads version {TRAINER_STATE_VERSION} only. Resume with the version "
            "of the runtime that saved it, or start the run in a fresh output directory."
        )
    optional = {STATEFUL_SECTION} & set(state)
    check_state_keys(state, TRAINER_STATE_SECTIONS | optional, what="trainer")
    return state


def save_stateful(objects: Mapping[str, Stateful]) -> dict[str, Any]:
    """The section of ``objects`` by name, to merge into the trainer state."""
    # Absent without stateful objects, so such a checkpoint reads as it always did.
    if not objects:
        return {}
    return {STATEFUL_SECTION: {name: obj.state_dict() for name, obj in objects.items()}}


def load_stateful(objects: Mapping[str, Stateful], saved: Mapping[str, Any]) -> None:
    """Restore the objects the checkpoint holds; one without a saved state keeps its own (it is
    new in this launch), and a saved state without an object is left unused, each with a
    warning."""
    for name, obj in objects.items():
        if name in saved:
            obj.load_state_dict(saved[name])
        else:
            log.warning("The checkpoint holds no state of %s; it starts from its own.", name)
    unused = sorted(set(saved) - set(objects))
    if unused:
        log.warning(
            "The checkpoint holds the state of %s, but nothing of that name is registered "
            "(a callback or Trainer.register_stateful) in this launch; it is not used.",
            ", ".join(unused),
        )
