"""The ``stateful`` section of a trainer state: the stateful callbacks and registered objects."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from runtime.training.early_stop import Stateful
from runtime.training.state import STATEFUL_SECTION

log = logging.getLogger(__name__)


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
