"""What every case gets from the command line, and the step-time contenders and the paired
comparison several cases share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

from benchmarks.loops import LOOPS, missing_requirement
from benchmarks.runner import Comparison, Contender, Metric


@final
@dataclass(frozen=True)
class SuiteSettings:
    quick: bool
    checkpoint_params_millions: float


STEP_TIME = Metric("step_time_s", "step time", "s")
PEAK_RSS = Metric("max_rss_bytes", "peak RSS", "bytes")
HAND_WRITTEN = LOOPS["hand"].label
PAIRED = "this project, taking turns with the hand-written loop"
PAIRED_COUNTED = "this project, taking turns with the hand-written loop normalizing as it does"
_PAIRED_NAMES = {"plain": PAIRED, "counted": PAIRED_COUNTED}


def step_contender(
    loop: str,
    workload: str,
    settings: SuiteSettings,
    *,
    nproc: int = 1,
    num_prefetch: int = 0,
    name: str | None = None,
) -> Contender:
    args = ["--workload", workload, "--loop", loop, "--num-prefetch", str(num_prefetch)]
    if settings.quick:
        args.append("--quick")
    return Contender(
        name=name or LOOPS[loop].label,
        module="benchmarks.step_worker",
        args=tuple(args),
        nproc=nproc,
        skip_reason=missing_requirement(loop),
    )


def all_loops(
    workload: str, settings: SuiteSettings, *, nproc: int = 1, also: tuple[str, ...] = ()
) -> tuple[Contender, ...]:
    """The hand-written loop, the frameworks, the loops in ``also`` and this project's Trainer,
    in the table's order."""
    return tuple(
        step_contender(loop, workload, settings, nproc=nproc)
        for loop in ("hand", "lightning", "torchtnt", "accelerate", *also, "trainer")
    )


def no_cuda_reason() -> str | None:
    """Why the GPU cases cannot run here, or None when they can."""
    import torch

    if torch.cuda.is_available():
        return None
    return "no CUDA device here (torch.cuda.is_available() is False)"


def paired_comparison(
    *,
    key: str,
    title: str,
    settings: SuiteSettings,
    nproc: int = 1,
    workload: str = "mlp",
    hands: tuple[str, ...] = ("plain",),
    skip_reason: str | None = None,
) -> Comparison:
    """The Trainer and the hand-written loop taking turns on ``workload`` (W1's by default) in
    ``nproc`` processes (DDP over gloo when more than one): one contender for each of ``hands``,
    the hand-written steps of :data:`~benchmarks.loops.hand_loop.HAND_STEPS`."""
    notes = [
        "The loops alternate in blocks of 50 steps (10 with --quick); each Trainer block is "
        "compared with the mean of the hand-written blocks before and after it, so each pair "
        "sees the same moment of the host. Each figure is the median over the blocks of a "
        "process; the table gives the median of the processes."
    ]
    if nproc > 1:
        notes.append(
            f"Every one of the {nproc} ranks takes the same turns; the hand-written loop is DDP "
            "on the Trainer's process group. The figures are rank 0's."
        )
    return Comparison(
        key=key,
        title=title,
        baseline=PAIRED,
        metrics=(
            Metric("trainer_step_s", "Trainer step", "s", ratio=False),
            Metric("hand_step_s", "hand-written step", "s", ratio=False),
            Metric("extra_s", "Trainer step - hand-written step", "s", ratio=False),
            Metric("ratio", "Trainer step / hand-written step", "ratio", ratio=False),
        ),
        contenders=tuple(
            Contender(
                name=_PAIRED_NAMES[hand],
                module="benchmarks.paired_worker",
                args=(
                    *("--workload", workload, "--hand", hand),
                    *(("--quick",) if settings.quick else ()),
                ),
                nproc=nproc,
                skip_reason=skip_reason,
            )
            for hand in hands
        ),
        notes=tuple(notes),
    )
