"""Dynamic loss scaling for fp16 training."""

from __future__ import annotations

import logging
import math
from typing import Any, final

from torch import Tensor

from runtime.errors import NonFiniteError

log = logging.getLogger(__name__)


@final
class LossScaler:
    """Scales the loss so fp16 gradients do not underflow, and backs off on overflow.

    A step whose gradient norm is not finite is skipped and the scale halves; after
    ``growth_interval`` good steps in a row the scale doubles. Reading the norm to decide is the
    one host sync per step that fp16 needs; with ``enabled=False`` nothing is read.
    """

    def __init__(
        self,
        *,
        init_scale: float,
        min_scale: float,
        enabled: bool,
        growth_interval: int = 2000,
    ) -> None:
        if init_scale <= 0 or min_scale <= 0 or min_scale > init_scale:
            raise ValueError(
                "fp16_loss_scale must be (initial, minimum) with 0 < minimum <= initial, "
                f"but is ({init_scale}, {min_scale}) instead."
            )
        self._scale = init_scale
        self._min_scale = min_scale
        self._enabled = enabled
        self._growth_interval = growth_interval
        self._good_steps = 0

    @staticmethod
    def from_option(option: tuple[float, ...], *, enabled: bool) -> LossScaler:
        """From the Trainer's ``fp16_loss_scale``: ``(initial, minimum[, growth_interval])``."""
        if len(option) not in (2, 3):
            raise ValueError(
                "fp16_loss_scale must be (initial, minimum) or (initial, minimum, "
                f"growth_interval), but is {option} instead."
            )
        growth_interval = int(option[2]) if len(option) == 3 else 2000
        if growth_interval <= 0:
            raise ValueError(
                f"The growth interval of fp16_loss_scale must be greater than zero, but is "
                f"{growth_interval} instead."
            )
        return LossScaler(
            init_scale=option[0],
            min_scale=option[1],
            enabled=enabled,
            growth_interval=growth_interval,
        )

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def scale(self) -> float:
        return self._scale if self._enabled else 1.0

    def update(self, grad_norm: Tensor, step_nr: int) -> bool:
        """Return whether the step may apply its gradients; adjust the scale."""
        if not self._enabled:
            return True
        if math.isfinite(grad_norm.item()):
            self._good_steps += 1
            if self._good_steps == self._growth_interval:
                self._scale *= 2.0
                self._good_steps = 0
            return True
        self._good_steps = 0
        new_scale = self._scale / 2.0
        if new_scale < self._min_scale:
            raise NonFiniteError(
                f"The fp16 loss scale fell below its minimum {self._min_scale} at step {step_nr}: "
                "the gradients overflow at any scale, so the training has diverged. Lower the "
                "learning rate, clip gradients (max_gradient_norm), or train in bfloat16."
            )
        log.warning(
            "Gradient overflow at step %d: skipped the step, loss scale %g -> %g.",
            step_nr,
            self._scale,
            new_scale,
        )
        self._scale = new_scale
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
