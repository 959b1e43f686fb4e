"""One process of the Llama GPU cases: train the ~1B Llama-style model on one GPU with one loop,
or time its checkpoint.

``python -m benchmarks.gpu_worker --loop {hand,trainer,lightning,accelerate} [--quick]``: bf16
autocast over float32 weights, every block compiled, fused AdamW, random tokens. Prints
``BENCH_RESULT {"tokens_per_s": ..., "mfu": ..., "peak_memory_bytes": ..., "step_time_s": ...}``;
``mfu`` only on a device whose peak is known (``runtime.metrics.train_metrics``).

``python -m benchmarks.gpu_worker --checkpoint [--quick]``: the model with AdamW state after one
step, saved asynchronously by ``CheckpointManager``: ``async_blocked_s`` (the call), the same of
a second save (staging buffers reused), ``save_gb_per_s`` (the call to the commit) and
``load_gb_per_s``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, final

import torch
from torch import Tensor, nn

from benchmarks.probe import emit, exit_now
from benchmarks.workloads.llama import Llama, LlamaShape, random_tokens, summed_loss

LOOP_NAMES = ("hand", "trainer", "lightning", "accelerate")
LR = 1e-4


@final
class CudaStepTimer:
    """Seconds per step after ``num_warmup``, read with the GPU idle at both ends."""

    def __init__(self, *, num_warmup: int, num_steps: int) -> None:
        self._num_warmup, self._num_steps = num_warmup, num_steps
        self._num_seen = 0
        self._start = self._end = 0.0
        self.peak_memory_bytes = 0

    def step_end(self) -> None:
        self._num_seen += 1
        if self._num_seen in (self._num_warmup, self._num_steps):
            torch.cuda.synchronize()
            now = time.perf_counter()
            if self._num_seen == self._num_warmup:
                self._start = now
                torch.cuda.reset_peak_memory_stats()
            else:
                self._end = now
                # Read here: a loop may reset the allocator's peak after its last step (the
                # Trainer does at its publish).
                self.peak_memory_bytes = torch.cuda.max_memory_allocated()

    def seconds_per_step(self) -> float:
        if self._num_seen < self._num_steps:
            raise RuntimeError(f"The loop stopped after {self._num_seen} of {self._num_steps}.")
        return (self._end - self._start) / (self._num_steps - self._num_warmup)


def make_model(shape: LlamaShape) -> Llama:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Llama(shape)
    model.compile_blocks()
    return model


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, fused=True)


def mean_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    """What the frameworks' loops backpropagate: the mean over the targets, with bf16 autocast
    where the framework does not add it itself."""
    loss, num_targets = summed_loss(model, tokens.to("cuda", non_blocking=True))
    return loss / num_targets


def run_hand(shape: LlamaShape, timer: CudaStepTimer, num_steps: int) -> Llama:
    model = make_model(shape)
    optimizer = make_optimizer(model)
    tokens = random_tokens(shape, 64 * shape.batch_size).cuda()
    for step_nr in range(num_steps):
        start = (step_nr % 64) * shape.batch_size
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = mean_loss(model, tokens[start : start + shape.batch_size])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.step_end()
    return model


def run_trainer(shape: LlamaShape, timer: CudaStepTimer, num_steps: int) -> Llama:
    from checkpoint import CheckpointManager
    from gangs import setup_gangs
    from runtime import MapDataReader, Trainer, TrainerCallback
    from units import TrainUnit

    class Clock(TrainerCallback):
        def on_step_end(self, *, step_nr: int, metrics: Mapping[str, Any] | None) -> None:
            timer.step_end()

    class LlamaUnit(TrainUnit[Tensor]):
        def __call__(self, batch: Tensor) -> tuple[Tensor, int | None]:
            # A no-op where the Trainer placed the batch on the GPU already.
            return summed_loss(self.model, batch.to("cuda", non_blocking=True))

    gangs = setup_gangs()
    model = make_model(shape)
    Trainer(
        unit=LlamaUnit(model),
        data_reader=MapDataReader(
            dataset=random_tokens(shape, 64 * shape.batch_size),  # type: ignore[arg-type]
            batch_size=shape.batch_size,
            gang=gangs.dp,
            collate=torch.stack,
            num_prefetch=2,
        ),
        optimizer=make_optimizer(model),
        # Saves nothing while timed: the only checkpoint would follow the last step.
        checkpoint_manager=CheckpointManager(Path(os.environ["BENCH_SCRATCH"]) / "ckpt", gangs),
        checkpoint_every_n_steps=None,
        gangs=gangs,
        dtype=torch.bfloat16,
        amp=True,
        max_num_steps=num_steps,
        publish_metrics_every_n_steps=num_steps,
        callbacks=[Clock()],
        progress=False,
    ).run()
    return model


def run_accelerate(shape: LlamaShape, timer: CudaStepTimer, num_steps: int) -> Llama:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    accelerator = Accelerator(mixed_precision="bf16")
    model = make_model(shape)
    loader = DataLoader(
        random_tokens(shape, 64 * shape.batch_size),  # type: ignore[arg-type]
        batch_size=shape.batch_size,
        shuffle=True,
        drop_last=True,
        pin_memory=True,
    )
    prepared, optimizer, loader = accelerator.prepare(model, make_optimizer(model), loader)
    step_nr = 0
    while step_nr < num_steps:
        for tokens in loader:
            with accelerator.autocast():
                loss = mean_loss(prepared, tokens)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            timer.step_end()
            step_nr += 1
            if step_nr == num_steps:
                break
    return model


def run_lightning(shape: LlamaShape, timer: CudaStepTimer, num_steps: int) -> Llama:
    import lightning as L
    from torch.utils.data import DataLoader

    class LlamaModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model(shape)

        def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
            return mean_loss(self.model, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(self.model)

    class Clock(L.Callback):
        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            timer.step_end()

    module = LlamaModule()
    L.Trainer(
        accelerator="gpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=num_steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Clock()],
    ).fit(
        module,
        DataLoader(
            random_tokens(shape, 64 * shape.batch_size),  # type: ignore[arg-type]
            batch_size=shape.batch_size,
            shuffle=True,
            drop_last=True,
            pin_memory=True,
        ),
    )
    return module.model


LOOPS = {
    "hand": run_hand,
    "trainer": run_trainer,
    "lightning": run_lightning,
    "accelerate": run_accelerate,
}


def bench_loop(loop: str, shape: LlamaShape, *, quick: bool) -> dict[str, float]:
    from runtime.metrics.device_peaks import peak_flops

    num_warmup, num_steps = (3, 8) if quick else (10, 40)
    timer = CudaStepTimer(num_warmup=num_warmup, num_steps=num_steps)
    model = LOOPS[loop](shape, timer, num_steps)
    seconds = timer.seconds_per_step()
    tokens_per_s = shape.batch_size * shape.seq_len / seconds
    figures = {
        "step_time_s": seconds,
        "tokens_per_s": tokens_per_s,
        "peak_memory_bytes": float(timer.peak_memory_bytes),
    }
    peak = peak_flops(torch.cuda.get_device_name(), "bf16")
    if peak is not None:
        num_parameters = sum(p.numel() for p in model.parameters())
        figures["mfu"] = tokens_per_s * shape.flops_per_token(num_parameters) / peak
    return figures


def bench_checkpoint(shape: LlamaShape) -> dict[str, float]:
    from checkpoint import CheckpointManager
    from gangs import Gangs

    model = Llama(shape).cuda()
    optimizer = make_optimizer(model)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        mean_loss(model, random_tokens(shape, shape.batch_size)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    num_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    manager = CheckpointManager(
        Path(os.environ["BENCH_SCRATCH"]) / "checkpoints", Gangs.single(torch.device("cuda", 0))
    )
    figures: dict[str, float] = {"checkpoint_bytes": float(num_bytes)}
    for step_nr, key in ((1, "async_blocked_s"), (2, "async_blocked_later_s")):
        torch.cuda.synchronize()
        start = time.perf_counter()
        manager.save_checkpoint(
            step_nr,
            model=model,
            optimizer=optimizer,
            trainer_state={"step_nr": step_nr},
            async_checkpoint=True,
        )
        figures[key] = time.perf_counter() - start
        manager.finish_pending_save()
        figures.setdefault("save_gb_per_s", num_bytes / (time.perf_counter() - start) / 1e9)
        if step_nr == 2:
            manager.delete_checkpoint(1)  # two copies of 13 GB would crowd the scratch disk
    torch.cuda.synchronize()
    start = time.perf_counter()
    manager.load_checkpoint(2, model=model, optimizer=optimizer)
    torch.cuda.synchronize()
    figures["load_gb_per_s"] = num_bytes / (time.perf_counter() - start) / 1e9
    manager.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--loop", choices=LOOP_NAMES)
    group.add_argument("--checkpoint", action="store_true")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_worker: no CUDA device here.")
    shape = LlamaShape.of(quick=args.quick)
    if args.checkpoint:
        figures = bench_checkpoint(shape)
    else:
        figures = bench_loop(args.loop, shape, quick=args.quick)
    emit(figures, with_rss=False)
    exit_now()


if __name__ == "__main__":
    main()
