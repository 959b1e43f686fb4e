"""One process (or one rank) of the checkpoint comparison: save, load and async save, timed.

``python -m benchmarks.checkpoint_worker --tool {dcp,project} --params-millions N
[--checkpoint-io {fast,public}]`` (under ``torchrun`` for several ranks). The model is shaped like
a small transformer (see :func:`make_model`) with AdamW state after one step, replicated by DDP on
several ranks; both tools write it to ``BENCH_SCRATCH``.

- ``dcp``: what a user writes with ``torch.distributed.checkpoint`` alone: one ``dcp.save`` of
  the model and optimizer state dicts, one ``dcp.load``, and ``dcp.async_save``.
- ``project``: ``CheckpointManager`` through its public calls only, on the way through DCP that
  ``--checkpoint-io`` names (``TRAINKIT_CHECKPOINT_IO``; unset: chosen by torch version).
- ``project-loads``: one save, then ``--rounds`` loads on each of the project's two ways through
  DCP, taking turns in the process (see :func:`bench_project_loads`).

``load_s`` reads the files the save just wrote, from the page cache; ``load_cold_s`` reads them
again after each rank evicted its files from the page cache (``posix_fadvise(DONTNEED)``: no root
needed, and nothing else on the machine loses its cache).

``async_blocked_s`` is how long the caller is blocked by an async save: the call itself, plus the
later wait for (and commit of) the save after the write had time to finish in the background,
as a training loop sees it at its next checkpoint. That of the first async save of the process;
``async_blocked_later_s`` is that of the next one, which may reuse what the first set up (staging
memory, process groups), as every save of a run after its first does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from benchmarks.cases.checkpoint import (
    FFN_PER_DIM,
    NUM_BLOCKS,
    VOCAB_PER_DIM,
    model_dim,
)
from benchmarks.probe import emit, exit_now, use_one_thread
from checkpoint import CheckpointManager
from gangs import Gangs, setup_gangs
from runtime import apply_data_parallel


class Block(nn.Module):
    """The tensors of a Llama-style block (attention, gated MLP, two norms); never run."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.ffn_norm = nn.RMSNorm(dim)
        self.gate, self.up = (nn.Linear(dim, FFN_PER_DIM * dim, bias=False) for _ in range(2))
        self.down = nn.Linear(FFN_PER_DIM * dim, dim, bias=False)


def make_model(params_millions: float) -> nn.Module:
    """A transformer's shape mix of about ``params_millions`` parameters: an embedding and an
    untied output over a vocabulary of 32 x dim, 12 blocks of 13 dim^2 each (4 of attention,
    3 x 3 of MLP) and norms; 111 tensors, from vectors of dim to matrices of 32 dim^2."""
    dim = model_dim(params_millions)
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(VOCAB_PER_DIM * dim, dim),
        *(Block(dim) for _ in range(NUM_BLOCKS)),
        nn.RMSNorm(dim),
        nn.Linear(dim, VOCAB_PER_DIM * dim, bias=False),
    )


def take_one_step(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with its state allocated, as it is in a checkpoint taken during training."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes of the model's and optimizer's tensors on this rank."""
    tensors = [*model.state_dict().values()]
    tensors += [value for state in optimizer.state.values() for value in state.values()]
    return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))


def timed(gangs: Gangs, action: Callable[[], Any]) -> float:
    """Seconds until every rank has finished ``action``."""
    gangs.root.barrier()
    start = time.perf_counter()
    action()
    gangs.root.barrier()
    return time.perf_counter() - start


def evict(directory: Path) -> None:
    """Drop the files below ``directory`` from the page cache (they were fsynced: clean pages),
    so the next load reads them from the disk."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def bench_dcp(gangs: Gangs, model: nn.Module, optimizer: Any, scratch: Path) -> dict[str, float]:
    def state() -> dict[str, Any]:
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def load() -> None:
        loaded = state()
        dcp.load(loaded, checkpoint_id=scratch / "sync")
        set_state_dict(
            model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"]
        )

    # The background write runs collectives on a thread of its own: on the group of the loop (and
    # its barriers) they can interleave differently on two ranks and hang, as DCP's docs warn.
    async_group = dist.new_group(backend="gloo") if gangs.root.size > 1 else None
    futures: list[Any] = []
    save_s = timed(gangs, lambda: dcp.save(state(), checkpoint_id=scratch / "sync"))
    load_s = timed(gangs, load)
    evict(scratch / "sync")
    load_cold_s = timed(gangs, load)

    def async_blocked(name: str) -> float:
        futures.clear()
        stage_s = timed(
            gangs,
            lambda: futures.append(
                dcp.async_save(state(), checkpoint_id=scratch / name, process_group=async_group)
            ),
        )
        time.sleep(3 * save_s + 0.5)
        return stage_s + timed(gangs, lambda: futures[0].result())

    return {
        "save_s": save_s,
        "load_s": load_s,
        "load_cold_s": load_cold_s,
        "async_blocked_s": async_blocked("async"),
        "async_blocked_later_s": async_blocked("async_2"),
    }


def bench_project(
    gangs: Gangs, model: nn.Module, optimizer: Any, scratch: Path
) -> dict[str, float]:
    manager = CheckpointManager(scratch / "checkpoints", gangs)

    def save(step_nr: int, *, async_checkpoint: bool) -> None:
        manager.save_checkpoint(
            step_nr,
            model=model,
            optimizer=optimizer,
            trainer_state={"step_nr": step_nr},
            async_checkpoint=async_checkpoint,
        )

    def load() -> None:
        manager.load_checkpoint(1, model=model, optimizer=optimizer)

    def async_blocked(step_nr: int) -> float:
        stage_s = timed(gangs, lambda: save(step_nr, async_checkpoint=True))
        time.sleep(3 * save_s + 0.5)
        return stage_s + timed(gangs, manager.finish_pending_save)

    save_s = timed(gangs, lambda: save(1, async_checkpoint=False))
    load_s = timed(gangs, load)
    evict(manager.checkpoint_path(1))
    load_cold_s = timed(gangs, load)
    return {
        "save_s": save_s,
        "load_s": load_s,
        "load_cold_s": load_cold_s,
        "async_blocked_s": async_blocked(2),
        "async_blocked_later_s": async_blocked(3),
    }


def bench_project_loads(
    gangs: Gangs, model: nn.Module, optimizer: Any, scratch: Path, *, rounds: int
) -> dict[str, float]:
    """The loads of one checkpoint on each path, taking turns in one process (fast, public,
    public, fast, ...), so both see the same moments of the host: each from the page cache and
    evicted from it. The medians of each path, and of the ratio of each pair."""
    manager = CheckpointManager(scratch / "checkpoints", gangs)
    manager.save_checkpoint(
        1, model=model, optimizer=optimizer, trainer_state={"step_nr": 1}, async_checkpoint=False
    )
    times: dict[str, list[float]] = {}
    for round_nr in range(rounds):
        for path in ("fast", "public") if round_nr % 2 == 0 else ("public", "fast"):
            os.environ["TRAINKIT_CHECKPOINT_IO"] = path
            evict(manager.checkpoint_path(1))
            for key in ("load_cold_s", "load_s"):
                seconds = timed(
                    gangs, lambda: manager.load_checkpoint(1, model=model, optimizer=optimizer)
                )
                times.setdefault(f"{path}_{key}", []).append(seconds)
    figures = {key: statistics.median(values) for key, values in times.items()}
    for key in ("load_s", "load_cold_s"):
        pairs = zip(times[f"fast_{key}"], times[f"public_{key}"], strict=True)
        figures[f"public_over_fast_{key}"] = statistics.median(p / f for f, p in pairs)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool", choices=("dcp", "project", "project-loads"), required=True)
    parser.add_argument("--params-millions", type=float, default=100.0)
    parser.add_argument(
        "--checkpoint-io",
        choices=("fast", "public"),
        default=None,
        help="the project's way through DCP (TRAINKIT_CHECKPOINT_IO); default: by torch version",
    )
    parser.add_argument("--rounds", type=int, default=6, help="rounds of --tool project-loads")
    args = parser.parse_args()
    if args.checkpoint_io is not None:
        os.environ["TRAINKIT_CHECKPOINT_IO"] = args.checkpoint_io
    use_one_thread()
    gangs = setup_gangs(tp_size=1)
    model = apply_data_parallel(make_model(args.params_millions), gangs, kind="ddp")
    optimizer = take_one_step(model)
    scratch = Path(os.environ["BENCH_SCRATCH"])
    if args.tool == "project-loads":
        figures = bench_project_loads(gangs, model, optimizer, scratch, rounds=args.rounds)
    else:
        bench = bench_dcp if args.tool == "dcp" else bench_project
        figures = bench(gangs, model, optimizer, scratch)
        size = state_bytes(model, optimizer)
        figures["state_bytes"] = float(size)
        for key in ("save", "load", "load_cold"):
            figures[f"{key}_gb_per_s"] = size / figures[f"{key}_s"] / 1e9
    emit(figures, with_rss=False)
    exit_now()


if __name__ == "__main__":
    main()
