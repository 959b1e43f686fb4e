"""A device out-of-memory error in a training step, turned into one error that says what to do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

import torch

from runtime.errors import TrainerError


class StepOutOfMemoryError(TrainerError):
    """A training step ran out of device memory. The message names the step, the memory figures
    and the ways out; the checkpoints already committed are untouched."""


@final
@dataclass(frozen=True)
class MemoryFigures:
    """What CUDA's caching allocator reports for one device, in bytes."""

    allocated: int
    reserved: int
    max_allocated: int
    total: int

    @staticmethod
    def of(device: torch.device) -> MemoryFigures | None:
        """The figures of ``device``; None where it is no CUDA device (or CUDA cannot say)."""
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        try:
            return MemoryFigures(
                allocated=torch.cuda.memory_allocated(device),
                reserved=torch.cuda.memory_reserved(device),
                max_allocated=torch.cuda.max_memory_allocated(device),
                total=torch.cuda.get_device_properties(device).total_memory,
            )
        except RuntimeError:
            # After some out-of-memory errors the driver answers no query; the message then
            # goes without figures rather than hiding the out-of-memory behind a second error.
            return None

    def describe(self) -> str:
        return (
            f"{_gib(self.allocated)} allocated, {_gib(self.reserved)} reserved by PyTorch's "
            f"caching allocator, {_gib(self.max_allocated)} at the peak, of {_gib(self.total)} "
            "on the device"
        )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def step_out_of_memory_error(
    step_nr: int, *, device: torch.device, rank: int, figures: MemoryFigures | None
) -> StepOutOfMemoryError:
    """The error for an out-of-memory of ``device`` in step ``step_nr`` on ``rank``."""
    memory = (
        f"Memory of {device}: {figures.describe()}."
        if figures is not None
        else f"{device} reports no memory figures."
    )
    return StepOutOfMemoryError(
        f"Step {step_nr} ran out of device memory on rank {rank}. {memory} Ways out: turn on "
        "activation checkpointing (recompute the blocks' activations in the backward pass), "
        "use a smaller micro-batch (and more gradient accumulation to keep the step's batch), "
        "or shard the model, gradients and optimizer state with FSDP2 across the data-parallel "
        "ranks. The checkpoints committed so far are intact; the run resumes from the last one."
    )
