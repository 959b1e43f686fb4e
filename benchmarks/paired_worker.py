"""One process of the paired cases: the Trainer and the hand-written loop take turns, a block of
steps each (W1 in one process; W3 under ``torchrun``, where every rank takes the same turns and
the hand-written loop is DDP on the same process group).

``python -m benchmarks.paired_worker [--quick] [--block-size N] [--workload mlp|gpu_mlp]
[--hand plain|counted]`` (``gpu_mlp``: the GPU host-overhead case, on one GPU; ``counted``: the
hand-written DDP loop normalizes over the ranks as the Trainer does). Rank 0 prints
``BENCH_RESULT {"trainer_step_s": ..., "hand_step_s": ..., "extra_s": ..., "ratio": ...}``: over
the blocks after warm-up, the medians of the Trainer's time per step, of the hand-written
loop's, of their difference and of their ratio. Each Trainer block is compared with the mean of
the hand-written blocks right before and after it, so a host that speeds up or slows down
steadily cancels out.

Separate processes see the host at different moments, and on a shared host their step times
move by more than the Trainer's cost. Here the two loops alternate every few tens of
milliseconds, so each pair sees the same moment of the host. The blocks are long enough that
each loop runs with its caches warm, as it does alone: only its first step after a switch pays
for the other's evictions.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any, final

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.loops.hand_loop import HAND_STEPS, slice_starts
from benchmarks.loops.registry import LoopOptions
from benchmarks.loops.trainer_loop import make_trainer
from benchmarks.probe import emit, exit_now, rank, use_one_thread, world_size
from benchmarks.workloads import Workload, make_workload
from runtime import TrainerCallback


@final
class BlockTurns(TrainerCallback):
    """After every ``block_size``-th Trainer step, takes ``block_size`` hand-written steps (its
    own model and optimizer, under DDP on several ranks); records each block's time per step."""

    def __init__(
        self,
        workload: Workload,
        *,
        block_size: int,
        hand: str = "plain",
        synchronize: Callable[[], None] | None = None,
    ) -> None:
        self._workload = workload
        self._hand_step = HAND_STEPS[hand]
        # On a GPU the clock is read with the device idle, so neither loop's block is charged
        # for work the other queued.
        self._synchronize = synchronize or (lambda: None)
        self._block_size = block_size
        self._num_ranks = world_size()
        self._starts = slice_starts(workload, num_ranks=self._num_ranks, rank=rank())
        self._model: nn.Module = workload.make_model()
        self._optimizer = torch.optim.AdamW(self._model.parameters(), lr=workload.lr)
        self._trainer_start: float | None = None
        self.trainer_blocks: list[float] = []
        self.hand_blocks: list[float] = []

    def on_train_begin(self, *, step_nr: int) -> None:
        # The Trainer has made the process group by now. Wrapping broadcasts rank 0's weights,
        # and every rank gets here at the same point.
        if self._num_ranks > 1:
            self._model = DistributedDataParallel(self._model)

    def on_step_end(self, *, step_nr: int, metrics: Mapping[str, Any] | None) -> None:
        if step_nr % self._block_size != 0:
            return
        self._synchronize()
        trainer_end = time.perf_counter()
        if self._trainer_start is not None:
            self.trainer_blocks.append((trainer_end - self._trainer_start) / self._block_size)
        for _ in range(self._block_size):
            self._hand_step(self._workload, self._model, self._optimizer, next(self._starts))
        self._synchronize()
        self._trainer_start = time.perf_counter()
        self.hand_blocks.append((self._trainer_start - trainer_end) / self._block_size)


def block_figures(
    trainer_blocks: list[float], hand_blocks: list[float], *, skip: int
) -> dict[str, float]:
    """The medians over the block pairs after the first ``skip`` (they hold the warm-up).

    Trainer block k ran between hand-written blocks k and k + 1; it is compared with their mean.
    """
    around = [(before + after) / 2 for before, after in itertools.pairwise(hand_blocks)]
    pairs = list(zip(trainer_blocks, around, strict=False))[skip:]
    if not pairs:
        raise ValueError(
            f"{len(trainer_blocks)} Trainer blocks make no pair after the {skip} of warm-up."
        )
    return {
        "trainer_step_s": statistics.median(trainer for trainer, _ in pairs),
        "hand_step_s": statistics.median(hand for _, hand in pairs),
        "extra_s": statistics.median(trainer - hand for trainer, hand in pairs),
        "ratio": statistics.median(trainer / hand for trainer, hand in pairs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--block-size", type=int, help="steps per turn (default 50, 10 quick)")
    parser.add_argument("--workload", choices=("mlp", "gpu_mlp"), default="mlp")
    parser.add_argument("--hand", choices=tuple(HAND_STEPS), default="plain")
    args = parser.parse_args()
    if args.hand == "counted" and world_size() == 1:
        parser.error("--hand counted normalizes over DDP ranks; run it under torchrun.")
    use_one_thread()
    workload = make_workload(args.workload)
    plan = workload.plan(quick=args.quick)
    block_size = args.block_size or (10 if args.quick else 50)
    synchronize = torch.cuda.synchronize if args.workload == "gpu_mlp" else None
    turns = BlockTurns(workload, block_size=block_size, hand=args.hand, synchronize=synchronize)
    make_trainer(workload, plan, LoopOptions(), turns).run()
    emit(
        block_figures(
            turns.trainer_blocks, turns.hand_blocks, skip=math.ceil(plan.num_warmup / block_size)
        ),
        with_rss=False,
    )
    exit_now()


if __name__ == "__main__":
    main()
