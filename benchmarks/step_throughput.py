"""Step throughput of the Trainer against a hand-written loop on the same model and data.

``python -m benchmarks.step_throughput [--steps N] [--warmup N] [--batch-size B] [--seq-len L]``

Both loops train the char-LM recipe's transformer with AdamW, gradient clipping and a summed
cross-entropy normalized by the number of targets. The hand-written loop is the floor: what the
Trainer adds on top (data reader, normalization all-reduce, metric windows, callbacks) is the
overhead reported. Steps are timed between two step-end moments, so set-up, compilation warm-up
and the final checkpoint are outside the window. Each loop runs ``--repeats`` times and the best
time counts: on a shared machine the slow runs measure the neighbours, not the loop.

The Trainer runs twice: with the reader's default background prefetching, and with
``num_prefetch=0``. When the training compute keeps every core busy (CPU training), the prefetch
thread competes with torch's intra-op threads; on a GPU the host thread idles while kernels run,
and prefetching is where the time of the next batch hides.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from checkpoint import CheckpointManager
from gangs import Gangs
from recipes.char_lm import (
    ByteTransformer,
    ByteWindows,
    CharLMTrainUnit,
    DataSection,
    LMBatch,
    ModelSection,
    collate_windows,
    load_corpus,
)
from runtime import MapDataReader, Trainer, TrainerCallback


class StepClock(TrainerCallback):
    """Times the steps after ``warmup`` until the last one."""

    def __init__(self, warmup: int) -> None:
        self._warmup = warmup
        self.start: float | None = None
        self.end: float | None = None

    def on_step_end(self, *, step_nr: int) -> None:
        if step_nr == self._warmup:
            self.start = time.perf_counter()
        self.end = time.perf_counter()


def hand_written_loop(
    windows: ByteWindows, args: argparse.Namespace, model_config: ModelSection
) -> float:
    """Seconds for ``args.steps - args.warmup`` steps of a plain PyTorch loop."""
    torch.manual_seed(0)
    model = ByteTransformer(model_config, args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(
        windows,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        collate_fn=collate_windows,
    )
    batches = iter(loader)
    start = 0.0
    for step_nr in range(1, args.steps + 1):
        batch: LMBatch = next(batches)
        logits = model(batch.inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="sum")
        torch.autograd.backward(loss / batch.num_targets)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step_nr == args.warmup:
            start = time.perf_counter()
    return time.perf_counter() - start


def trainer_loop(
    windows: ByteWindows, args: argparse.Namespace, model_config: ModelSection, *, num_prefetch: int
) -> float:
    """Seconds for the same steps driven by the Trainer."""
    torch.manual_seed(0)
    model = ByteTransformer(model_config, args.seq_len)
    gangs = Gangs.single()
    clock = StepClock(args.warmup)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(
            unit=CharLMTrainUnit(model),
            data_reader=MapDataReader(
                dataset=windows,
                batch_size=args.batch_size,
                collate=collate_windows,
                gang=gangs.dp,
                num_prefetch=num_prefetch,
            ),
            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
            checkpoint_manager=CheckpointManager(Path(tmp) / "checkpoints", gangs),
            gangs=gangs,
            max_num_steps=args.steps,
            publish_metrics_every_n_steps=args.publish_every,
            max_gradient_norm=1.0,
            callbacks=[clock],
            progress=False,
        )
        trainer.run()
    assert clock.start is not None and clock.end is not None
    return clock.end - clock.start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--publish-every", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not 0 < args.warmup < args.steps:
        parser.error(f"--warmup must be in (0, --steps), but is {args.warmup}.")

    torch.set_num_threads(max(1, torch.get_num_threads()))
    train_bytes, _ = load_corpus(DataSection(seq_len=args.seq_len))
    windows = ByteWindows(train_bytes, args.seq_len)
    model_config = ModelSection()

    timed_steps = args.steps - args.warmup
    targets_per_step = args.batch_size * args.seq_len
    loops: dict[str, Callable[[], float]] = {
        "hand-written loop": lambda: hand_written_loop(windows, args, model_config),
        "Trainer": lambda: trainer_loop(windows, args, model_config, num_prefetch=2),
        "Trainer, no prefetch": lambda: trainer_loop(windows, args, model_config, num_prefetch=0),
    }
    results = {name: min(loop() for _ in range(args.repeats)) for name, loop in loops.items()}
    print(
        f"{timed_steps} timed steps of {args.batch_size} x {args.seq_len} targets, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, best of {args.repeats}"
    )
    print(f"{'loop':<22}{'steps/s':>10}{'targets/s':>12}{'ms/step':>10}{'overhead':>10}")
    floor = results["hand-written loop"]
    for name, seconds in results.items():
        print(
            f"{name:<22}{timed_steps / seconds:>10.2f}"
            f"{timed_steps * targets_per_step / seconds:>12.0f}"
            f"{1000 * seconds / timed_steps:>10.1f}{100 * (seconds - floor) / floor:>+9.1f}%"
        )


if __name__ == "__main__":
    main()
