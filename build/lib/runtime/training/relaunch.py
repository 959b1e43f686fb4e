"""What a relaunch of a finished run does: one that reached a limit the relaunch lifts, or whose
data has gone on since, trains on."""

from __future__ import annotations

import logging
from collections.abc import Callable

from runtime.training.limits import Limits
from runtime.training.state import StopReason, TrainState

log = logging.getLogger(__name__)


def reopen_finished_run(
    state: TrainState, limits: Limits, wait_for_data: Callable[[], bool | None]
) -> None:
    """Clear the stop reason of a resumed run that can train on.

    A limit counts as it is now, so larger limits lift it; an early stop is final. A run whose
    data ended asks the reader again (``wait_for_data``: the reader's ``has_next_epoch``, None
    when a stop signal cut its wait short, which leaves the run preempted).
    """
    reason = state.stop_reason
    if reason is StopReason.END_OF_DATA:
        has_next = wait_for_data()
        if has_next is None:
            state.stop_reason = StopReason.PREEMPTED
        elif has_next:
            log.info(
                "The run's data ended at step %d, but the data reader has more now: training on.",
                state.step_nr,
            )
            state.stop_reason = None
    elif reason is not None and reason.is_limit and not limits.reached(state):
        log.info(
            "The run finished at step %d, but max_num_steps (%s) and max_num_data_epochs (%s) "
            "now allow more: training on.",
            state.step_nr,
            limits.max_num_steps,
            limits.max_num_data_epochs,
        )
        state.stop_reason = None
