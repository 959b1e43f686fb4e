"""What pipeline parallelism costs and saves per rank, on CPU: the step time of each schedule
with its measured bubble beside the theoretical one, and the parameter memory per rank.

Usage: ``torchrun --nproc-per-node PP benchmarks/pipeline.py [NUM_MICROBATCHES]`` (PP 2, 4;
``python benchmarks/pipeline.py`` for PP 1, one process, no pipeline). Rank 0 prints one JSON
line a schedule (PP 1: one line). The model is the project's Llama, small (dim 128, 4 heads,
8 layers, vocabulary 2,048), 16 sequences of 128 tokens a step, float32, one thread a process,
a summed cross-entropy; the layers split evenly over the stages.

The measured bubble is the share of the step a rank spends waiting for its sends and receives
(torch's ``_wait_batch_p2p``, timed), averaged over the ranks: the idle time the schedule
leaves, plus the transfers themselves. The theoretical one is ``(p - 1) / (m + p - 1)`` for
GPipe and 1F1B (p stages, m microbatches), divided by v, the stages a rank holds, for the
interleaved schedule; the zero-bubble schedules aim below it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from gangs import Gangs, setup_gangs
from models.llama import Llama, LlamaArgs
from models.pipeline import split_model
from runtime.parallel.pipeline import Pipeline, schedule_available, stage_ids
from units.pipeline import StageInputs

ARGS = LlamaArgs(
    vocab_size=2048, dim=128, num_layers=8, num_heads=4, num_kv_heads=4, ffn_dim=384,
    max_seq_len=128,
)  # fmt: skip
BATCH, SEQ_LEN = 16, 128
WARMUP, STEPS = 1, 3
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zbv": 2, "dualpipev": 2}
"""Each schedule and the stages a rank holds under it."""


def batch() -> tuple[Tensor, Tensor]:
    tokens = torch.randint(
        0, ARGS.vocab_size, (BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0)
    )
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


def parameter_mib(module: torch.nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20


def one_process() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Llama(ARGS)
    inputs, targets = batch()

    def step() -> None:
        loss_fn(model(inputs), targets).backward()

    for _ in range(WARMUP):
        step()
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    return {
        "pp_size": 1,
        "schedule": None,
        "step_seconds": round((time.perf_counter() - start) / STEPS, 3),
        "parameter_mib_per_rank": round(parameter_mib(model), 2),
    }


def measure(gangs: Gangs, schedule: str, num_microbatches: int) -> dict[str, Any]:
    from torch.distributed.pipelining import schedules

    pp, per_rank = gangs.pp.size, SCHEDULES[schedule]
    torch.manual_seed(0)
    whole = Llama(ARGS)
    ids = stage_ids(schedule, pp_rank=gangs.pp.rank, pp_size=pp, stages_per_rank=per_rank)
    stages, part = split_model(whole, ids, pp * per_rank)
    pipeline = Pipeline(
        stages=stages, part=part, ids=ids, gangs=gangs, schedule=schedule,
        num_microbatches=num_microbatches,
    )  # fmt: skip
    inputs, targets = batch()
    waited = [0.0]
    inner = schedules._wait_batch_p2p

    def timed_wait(work: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(work)
        finally:
            waited[0] += time.perf_counter() - start

    schedules._wait_batch_p2p = timed_wait

    def step() -> None:
        pipeline.step(StageInputs(args=(inputs,), target=targets, num_targets=None), loss_fn)
        part.zero_grad(set_to_none=True)

    try:
        for _ in range(WARMUP):
            step()
        waited[0] = 0.0
        dist.barrier()
        start = time.perf_counter()
        for _ in range(STEPS):
            step()
        seconds = time.perf_counter() - start
    finally:
        schedules._wait_batch_p2p = inner
    figures = torch.tensor([waited[0] / seconds, seconds / STEPS, parameter_mib(part)])
    gathered = [torch.zeros_like(figures) for _ in range(pp)]
    dist.all_gather(gathered, figures)
    table = torch.stack(gathered)
    theory = (pp - 1) / (num_microbatches + pp - 1) / per_rank
    return {
        "pp_size": pp,
        "schedule": schedule,
        "num_microbatches": num_microbatches,
        "stages_per_rank": per_rank,
        "step_seconds": round(float(table[:, 1].max()), 3),
        "bubble_measured": round(float(table[:, 0].mean()), 3),
        "bubble_theoretical": round(theory, 3),
        "parameter_mib_per_rank": [round(float(v), 2) for v in table[:, 2]],
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        print(json.dumps(one_process()), flush=True)
        sys.exit(0)
    microbatches = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    the_gangs = setup_gangs(pp_size=world_size)
    for name in SCHEDULES:
        if not schedule_available(name):
            continue
        result = measure(the_gangs, name, microbatches)
        if the_gangs.root.rank == 0:
            print(json.dumps(result), flush=True)
    the_gangs.root.close()
