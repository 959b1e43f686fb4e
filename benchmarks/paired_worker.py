"""One process of the paired W1 case: each Trainer step is followed by one hand-written step.

``python -m benchmarks.paired_worker [--quick]``. Prints ``BENCH_RESULT {"trainer_step_s": ...,
"hand_step_s": ..., "extra_s": ...}``: the medians, over the steps after warm-up, of the
Trainer's step, of the hand-written step, and of the difference between each Trainer step and
the hand-written step right after it.

Separate processes see the host at different moments, and on a shared host their step times
move by more than the Trainer's cost. Here the two loops alternate step by step, so both see the
same moment, and the median difference holds to a few microseconds. Each model evicts the
other's caches in between, so both steps cost more than they do alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import final

import torch

from benchmarks.loops.hand_loop import hand_step
from benchmarks.loops.registry import LoopOptions
from benchmarks.loops.trainer_loop import make_trainer
from benchmarks.probe import emit, exit_now, use_one_thread
from benchmarks.workloads import Workload, make_workload
from runtime import TrainerCallback


@final
class PairedSteps(TrainerCallback):
    """Times the Trainer's steps from the end of one hand-written step to the next step's end,
    and takes a hand-written step (its own model and optimizer) after each."""

    def __init__(self, workload: Workload) -> None:
        self._workload = workload
        self._model = workload.make_model()
        self._optimizer = torch.optim.AdamW(self._model.parameters(), lr=workload.lr)
        self._steps_per_epoch = workload.num_examples() // workload.batch_size
        self._hand_end: float | None = None
        self.trainer_steps: list[float] = []
        self.hand_steps: list[float] = []

    def on_step_end(self, *, step_nr: int) -> None:
        trainer_end = time.perf_counter()
        if self._hand_end is not None:
            self.trainer_steps.append(trainer_end - self._hand_end)
        start = (step_nr % self._steps_per_epoch) * self._workload.batch_size
        hand_step(self._workload, self._model, self._optimizer, start)
        self._hand_end = time.perf_counter()
        self.hand_steps.append(self._hand_end - trainer_end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    use_one_thread()
    workload = make_workload("mlp")
    plan = workload.plan(quick=args.quick)
    paired = PairedSteps(workload)
    make_trainer(workload, plan, LoopOptions(), paired).run()
    # Trainer step k (from the index 0 on) ran between hand-written steps k and k + 1.
    skip = plan.num_warmup
    trainer_steps = paired.trainer_steps[skip:]
    hand_steps = paired.hand_steps[skip + 1 :]
    extra = [t - h for t, h in zip(trainer_steps, hand_steps, strict=False)]
    emit(
        {
            "trainer_step_s": statistics.median(trainer_steps),
            "hand_step_s": statistics.median(hand_steps),
            "extra_s": statistics.median(extra),
        },
        with_rss=False,
    )
    exit_now()


if __name__ == "__main__":
    main()
