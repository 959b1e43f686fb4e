"""A device out-of-memory error in a step becomes one clear error, and loses no checkpoint.

The out-of-memory is simulated on CPU: the unit raises ``torch.cuda.OutOfMemoryError`` from its
forward, as CUDA's allocator does. ``tests/cuda`` makes a real one on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from checkpoint import CheckpointManager
from gangs import Gangs
from runtime import StepOutOfMemoryError, Trainer, TrainerError
from runtime.training.out_of_memory import MemoryFigures, step_out_of_memory_error
from tests.conftest import make_toy_trainer
from tests.workers.train_toy import ToyBatch, ToyModel, ToyUnit


class OutOfMemoryUnit(ToyUnit):
    """A ToyUnit whose forward runs out of memory at step ``oom_step``, as CUDA's would."""

    def __init__(self, model: nn.Module, *, oom_step: int | None) -> None:
        super().__init__(model, mean_loss=False, zero_targets=False)
        self._oom_step = oom_step
        self._step_nr = 0

    def set_step_nr(self, step_nr: int) -> None:
        self._step_nr = step_nr

    def __call__(self, batch: ToyBatch) -> tuple[Tensor, int | None]:
        if self._step_nr == self._oom_step:
            raise torch.cuda.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.10 GiB total)"
            )
        return super().__call__(batch)


def _trainer(tmp_path: Path, *, oom_step: int | None, async_checkpoint: bool) -> Trainer[ToyBatch]:
    torch.manual_seed(0)
    return make_toy_trainer(
        tmp_path,
        unit=OutOfMemoryUnit(ToyModel(), oom_step=oom_step),
        max_num_steps=8,
        checkpoint_every_n_steps=2,
        keep_last_n_checkpoints=None,
        async_checkpoint=async_checkpoint,
        checkpoint_manager=CheckpointManager(tmp_path / "checkpoints", Gangs.single()),
    )


def _visible_checkpoints(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())


@pytest.mark.parametrize("async_checkpoint", [False, True])
def test_an_out_of_memory_step_is_one_clear_error_and_keeps_the_checkpoints(
    tmp_path: Path, async_checkpoint: bool
) -> None:
    trainer = _trainer(tmp_path, oom_step=5, async_checkpoint=async_checkpoint)
    with pytest.raises(StepOutOfMemoryError) as raised:
        trainer.run()
    message = str(raised.value)
    assert isinstance(raised.value, TrainerError)
    assert message.startswith("Step 5 ran out of device memory on rank 0.")
    for way_out in ("activation checkpointing", "smaller micro-batch", "FSDP2"):
        assert way_out in message
    # The CPU has no allocator figures to give; the message says so instead of failing.
    assert "cpu reports no memory figures." in message
    assert isinstance(raised.value.__cause__, torch.cuda.OutOfMemoryError)

    # Every checkpoint committed before the error is still there and complete; no partial one
    # became visible. An asynchronous save still in flight (step 4's) was never committed, so
    # it stays invisible, as after any crash.
    committed = ["step_2"] if async_checkpoint else ["step_2", "step_4"]
    visible = [name for name in _visible_checkpoints(tmp_path) if not name.endswith(".tmp")]
    assert visible == committed
    for name in committed:
        assert (tmp_path / "checkpoints" / name / "manifest.json").is_file()

    # The run resumes from the last of them and finishes.
    resumed = _trainer(tmp_path, oom_step=None, async_checkpoint=async_checkpoint)
    assert resumed.run() == 0
    assert resumed.step_nr == 8


def test_the_out_of_memory_message_gives_the_allocator_figures() -> None:
    figures = MemoryFigures(
        allocated=70 * 2**30, reserved=75 * 2**30, max_allocated=78 * 2**30, total=80 * 2**30
    )
    error = step_out_of_memory_error(12, device=torch.device("cuda", 3), rank=3, figures=figures)
    assert str(error).startswith(
        "Step 12 ran out of device memory on rank 3. Memory of cuda:3: 70.00 GiB allocated, "
        "75.00 GiB reserved by PyTorch's caching allocator, 78.00 GiB at the peak, of 80.00 GiB "
        "on the device."
    )


def test_memory_figures_of_a_cpu_device_are_none() -> None:
    assert MemoryFigures.of(torch.device("cpu")) is None
