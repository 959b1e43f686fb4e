"""A tiny model with tied input and output embeddings, built through ``parallelize_model``
under ``torchrun``, for tests/runtime/parallel/test_tying.py.

Usage: ``tied_embeddings.py OUTPUT_DIR JSON_OPTIONS``. Options: ``kind`` (``ddp``, ``fsdp``,
``hsdp``), ``tp_size``, ``dp_shard_size``, ``plans`` (the TP plans to try, in order: ``blocks``
shards the blocks only and leaves the tied pair replicated, ``vocab`` also shards the tied pair
over the vocabulary, ``head_only`` shards the output projection alone, which cannot keep the
tie).

For each plan the worker builds the model, trains ``NUM_STEPS`` SGD steps on one global batch
split over the DP ranks, and saves and loads its state through ``torch.distributed.checkpoint``
into a second model built from another seed. Rank 0 writes ``results.pt``: per plan, either
``{"error": message}`` or ``{"tied": [whether the two modules held one parameter after the
build, after training, after the load], "trained": the full weights, "reference": the same
steps on one process, "loaded": the second model's full weights}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from gangs import Gangs, setup_gangs
from runtime import parallelize_model, unwrap_model
from tests.workers.leave import leave

VOCAB, DIM, SEQ_LEN, BATCH = 32, 16, 8, 4
NUM_STEPS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.relu(self.up(x)))


class TiedLM(nn.Module):
    """Embedding, two blocks, a norm and an output projection that shares the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.head(self.norm(x))
        return logits


def tp_plan(name: str) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {}
    for i in range(2):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    if name in ("vocab", "head_only"):
        plan["head"] = ColwiseParallel(output_layouts=Replicate())
    if name == "vocab":
        plan["embed"] = RowwiseParallel(input_layouts=Replicate())
    return plan


def build(gangs: Gangs, kind: Any, plan: str, seed: int) -> nn.Module:
    with torch.device("meta"):
        model = TiedLM()
    return parallelize_model(
        model, gangs, kind=kind, block_types=(Block,), seed=seed, tp_plan=tp_plan(plan)
    )


def is_tied(model: nn.Module) -> bool:
    inner = unwrap_model(model)
    assert isinstance(inner, TiedLM)
    return inner.head.weight is inner.embed.weight


def full_state(model: nn.Module) -> dict[str, Tensor]:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}


def train(model: nn.Module, gangs: Gangs) -> None:
    """SGD on the whole batch's mean loss: each DP rank its rows, the gradients averaged."""
    tokens = torch.randint(
        0, VOCAB, (BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(3)
    )
    rows = BATCH // gangs.dp.size
    mine = tokens[gangs.dp.rank * rows : (gangs.dp.rank + 1) * rows].to(gangs.root.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(NUM_STEPS):
        logits = model(mine[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def run_plan(gangs: Gangs, options: dict[str, Any], plan: str, out: Path) -> dict[str, Any]:
    try:
        model = build(gangs, options["kind"], plan, seed=5)
    except ValueError as ex:
        return {"error": str(ex)}
    tied = [is_tied(model)]
    train(model, gangs)
    tied.append(is_tied(model))
    reference = build(Gangs.single(), "ddp", "blocks", seed=5)
    train(reference, Gangs.single())

    checkpoint = out / f"checkpoint_{plan}"
    dcp.save(get_model_state_dict(model), checkpoint_id=checkpoint)
    loaded = build(gangs, options["kind"], plan, seed=6)
    state = get_model_state_dict(loaded)
    dcp.load(state, checkpoint_id=checkpoint)
    set_model_state_dict(loaded, state)
    tied.append(is_tied(loaded))
    return {
        "tied": tied,
        "trained": full_state(model),
        "reference": full_state(reference),
        "loaded": full_state(loaded),
    }


def main() -> None:
    out, options = Path(sys.argv[1]), json.loads(sys.argv[2])
    gangs = setup_gangs(
        tp_size=options.get("tp_size", 1), dp_shard_size=options.get("dp_shard_size")
    )
    results = {plan: run_plan(gangs, options, plan, out) for plan in options["plans"]}
    if gangs.root.rank == 0:
        torch.save(results, out / "results.pt")
    leave(gangs.root)


if __name__ == "__main__":
    main()
