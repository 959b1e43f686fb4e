"""A small training run on CUDA, as a recipe, for the CUDA suite (``tests/cuda``).

Usage: ``[torchrun ...] tests/cuda/cuda_run.py OUTPUT_DIR [--config key=value]...``. A regression
MLP of :class:`Block` modules (linear, GELU, dropout) on one GPU or several (DDP, FSDP2, TP), in
float32 or with bf16 autocast. The unit moves each batch to the GPU itself (a no-op where the
Trainer did it already), so the run works whoever places the data. Deterministic algorithms are
on: two runs of one config give the same bits.

A run that finishes writes the full parameters to ``OUTPUT_DIR/params.pt`` and, on rank 0,
``OUTPUT_DIR/allocator_peaks.json``: CUDA's ``max_memory_allocated`` of each publishing step's
window, read as the publish resets it (a callback's ``on_step_end`` comes after the reset).

- ``oom_at_step``: the forward of that step asks for twice the device's memory (a real CUDA
  out-of-memory error);
- ``mark_steps``: write ``OUTPUT_DIR/progress/step_N`` after each step; ``step_sleep`` paces them.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, final

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import TensorDataset, default_collate

from checkpoint import CheckpointManager
from gangs import Gangs, setup_gangs
from runtime import (
    MapDataReader,
    Trainer,
    TrainerCallback,
    apply_data_parallel,
    apply_tensor_parallel,
    compile_blocks,
    main,
)
from tests.workers.resume_toy import save_full_params
from units import TrainUnit

FEATURES = 32


@dataclass
class CudaRunConfig:
    max_num_steps: int = 20
    batch_size: int = 32
    """Examples per step on each DP rank."""
    hidden_size: int = 256
    dropout: float = 0.1
    kind: Literal["ddp", "fsdp"] = "ddp"
    tp_size: int = 1
    param_dtype: Literal["bfloat16"] | None = None
    amp: bool = False
    compile: bool = False
    sgd: bool = False
    """SGD (lr 0.05) instead of AdamW: updates proportional to the gradients, so a wrong
    normalization across ranks shows in the weights (AdamW's updates do not scale with them)."""
    checkpoint_every: int | None = 5
    async_checkpoint: bool = False
    reshard_on_resume: bool = False
    publish_every: int = 5
    oom_at_step: int | None = None
    mark_steps: bool = False
    step_sleep: float = 0.0


class Block(nn.Module):
    def __init__(self, size_in: int, size_out: int, dropout: float) -> None:
        super().__init__()
        self.linear = nn.Linear(size_in, size_out)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(F.gelu(self.linear(x)))


class CudaToyModel(nn.Module):
    def __init__(self, config: CudaRunConfig) -> None:
        super().__init__()
        self.up = Block(FEATURES, config.hidden_size, config.dropout)
        self.down = nn.Linear(config.hidden_size, FEATURES)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.up(x))


@final
class CudaToyUnit(TrainUnit[list[Tensor]]):
    def __init__(self, model: nn.Module, device: torch.device, oom_at_step: int | None) -> None:
        super().__init__(model)
        self._device = device
        self._oom_at_step = oom_at_step
        self._step_nr = 0

    def set_step_nr(self, step_nr: int) -> None:
        self._step_nr = step_nr

    def __call__(self, batch: list[Tensor]) -> tuple[Tensor, int | None]:
        x, y = (t.to(self._device, non_blocking=True) for t in batch)
        if self._step_nr == self._oom_at_step:
            total = torch.cuda.get_device_properties(self._device).total_memory
            torch.empty(2 * total, dtype=torch.uint8, device=self._device)
        loss = (self.model(x).float() - y).pow(2).sum()
        return loss, y.numel()


@final
class _Observer(TrainerCallback):
    def __init__(self, config: CudaRunConfig, output_dir: Path, rank: int) -> None:
        self._config = config
        self._output_dir = output_dir
        self._rank = rank
        self.allocator_peaks: dict[int, int] = {}
        self._peak_before_reset: int | None = None
        # On a CPU (a smoke run of this worker) there is no allocator to read.
        if torch.cuda.is_available():
            # The publish resets the peak before on_step_end runs: read it as the reset comes.
            reset = torch.cuda.reset_peak_memory_stats

            def read_then_reset(device: Any = None) -> None:
                self._peak_before_reset = torch.cuda.max_memory_allocated(device)
                reset(device)

            torch.cuda.reset_peak_memory_stats = read_then_reset

    def on_step_end(self, *, step_nr: int, metrics: object = None) -> None:
        if self._config.step_sleep:
            time.sleep(self._config.step_sleep)
        if step_nr % self._config.publish_every == 0 and self._peak_before_reset is not None:
            self.allocator_peaks[step_nr] = self._peak_before_reset
            self._peak_before_reset = None
        if self._config.mark_steps and self._rank == 0:
            progress = self._output_dir / "progress"
            progress.mkdir(exist_ok=True)
            (progress / f"step_{step_nr}").touch()


@final
class _CudaRun:
    def __init__(self, config: CudaRunConfig, gangs: Gangs, output_dir: Path) -> None:
        self._gangs = gangs
        self._output_dir = output_dir
        self._model = _build_model(config, gangs)
        self._observer = _Observer(config, output_dir, gangs.root.rank)
        self._trainer = _build_trainer(config, gangs, output_dir, self._model, self._observer)

    def run(self) -> int:
        code = self._trainer.run()
        if code == 0:
            save_full_params(self._model, self._gangs, self._output_dir / "params.pt")
            if self._gangs.root.rank == 0:
                peaks = json.dumps(self._observer.allocator_peaks)
                (self._output_dir / "allocator_peaks.json").write_text(peaks)
        return code


def _build_model(config: CudaRunConfig, gangs: Gangs) -> nn.Module:
    torch.manual_seed(0)
    model: nn.Module = CudaToyModel(config).to(gangs.root.device)
    model = apply_tensor_parallel(
        model, gangs, {"up.linear": ColwiseParallel(), "down": RowwiseParallel()}
    )
    param_dtype = None if config.param_dtype is None else getattr(torch, config.param_dtype)
    kind = "fsdp" if gangs.tp.size > 1 else config.kind
    model = apply_data_parallel(
        model, gangs, kind=kind, fsdp_units=(Block,), param_dtype=param_dtype
    )
    if config.compile:
        compile_blocks(model, block_types=(Block,))
    return model


def _build_trainer(
    config: CudaRunConfig,
    gangs: Gangs,
    output_dir: Path,
    model: nn.Module,
    observer: _Observer,
) -> Trainer[Any]:
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(4096, FEATURES, generator=generator)
    targets = torch.sin(inputs @ torch.randn(FEATURES, FEATURES, generator=generator))
    return Trainer(
        unit=CudaToyUnit(model, gangs.root.device, config.oom_at_step),
        data_reader=MapDataReader(
            dataset=TensorDataset(inputs, targets),
            batch_size=config.batch_size,
            collate=default_collate,
            gang=gangs.dp,
            seed=3,
        ),
        optimizer=(
            torch.optim.SGD(model.parameters(), lr=0.05)
            if config.sgd
            else torch.optim.AdamW(model.parameters(), lr=1e-3)
        ),
        checkpoint_manager=CheckpointManager(output_dir / "checkpoints", gangs),
        gangs=gangs,
        dtype=torch.bfloat16 if config.amp else torch.float32,
        amp=config.amp,
        max_num_steps=config.max_num_steps,
        max_gradient_norm=1.0,
        publish_metrics_every_n_steps=config.publish_every,
        metrics_dir=output_dir / "metrics",
        checkpoint_every_n_steps=config.checkpoint_every,
        keep_last_n_checkpoints=None,
        async_checkpoint=config.async_checkpoint,
        reshard_on_resume=config.reshard_on_resume,
        callbacks=[observer],
        progress=False,
    )


def recipe(config: CudaRunConfig, output_dir: Path) -> _CudaRun:
    # Deterministic kernels: a resumed run must match an uninterrupted one bit for bit. cuBLAS
    # reads its workspace setting when its first handle is made, after this.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    gangs = setup_gangs(tp_size=config.tp_size, timeout=timedelta(minutes=5))
    return _CudaRun(config, gangs, output_dir)


if __name__ == "__main__":
    main(recipe, CudaRunConfig)
