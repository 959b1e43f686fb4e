"""A toy training run under ``torchrun`` for the equivalence and checkpoint tests.

Usage: ``train_toy.py OUTPUT_DIR JSON_OPTIONS``. Trains a two-layer model whose examples carry a
varying number of targets, then rank 0 saves the full parameters to ``OUTPUT_DIR/params.pt``.
With ``{"runs": {NAME: OPTIONS, ...}}`` it makes each run in turn in one launch (one torchrun
start-up), into ``OUTPUT_DIR/NAME``; a run's ``torch_path`` (``private`` or ``public``) picks its
side of gangs.torch_versions.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torcheval.metrics import Mean

from checkpoint import CheckpointManager
from gangs import Gang, setup_parallel_gangs, setup_root_gang
from gangs.torch_versions import PRIVATE_APIS_ENV_VAR
from runtime import (
    MapDataReader,
    Trainer,
    TrainerCallback,
    apply_data_parallel,
    apply_tensor_parallel,
)
from tests.workers.leave import leave
from units import TrainUnit

NUM_TARGETS = 4


class ToyDataset(torch.utils.data.Dataset[dict[str, Tensor]]):
    """Inputs of 8 features; up to 4 regression targets each, the rest masked out."""

    def __init__(self, size: int) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, 8, generator=gen)
        self.y = torch.randn(size, NUM_TARGETS, generator=gen)
        counts = torch.randint(1, NUM_TARGETS + 1, (size,), generator=gen)
        self.mask = torch.arange(NUM_TARGETS)[None, :] < counts[:, None]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"x": self.x[index], "y": self.y[index], "mask": self.mask[index]}


@dataclass
class ToyBatch:
    x: Tensor
    y: Tensor
    mask: Tensor
    num_targets: int

    @property
    def batch_size(self) -> int:
        return self.x.size(0)


def collate(examples: list[dict[str, Tensor]]) -> ToyBatch:
    mask = torch.stack([e["mask"] for e in examples])
    return ToyBatch(
        x=torch.stack([e["x"] for e in examples]),
        y=torch.stack([e["y"] for e in examples]),
        mask=mask,
        num_targets=int(mask.sum()),
    )


class ToyModel(nn.Module):
    def __init__(self, *, hidden_size: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, hidden_size)
        self.down = nn.Linear(hidden_size, NUM_TARGETS)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(torch.tanh(self.up(self.norm(x))))


class ToyUnit(TrainUnit[ToyBatch]):
    def __init__(self, model: nn.Module, *, mean_loss: bool, zero_targets: bool) -> None:
        super().__init__(model)
        self._mean_loss = mean_loss
        self._zero_targets = zero_targets
        self.metric_bag.register_metric("toy_loss", Mean(), persistent=False)

    def __call__(self, batch: ToyBatch) -> tuple[Tensor, int | None]:
        errors = (self.model(batch.x) - batch.y).pow(2) * batch.mask
        if self._zero_targets:
            return errors.sum() * 0.0, 0
        if self._mean_loss:
            loss = errors.sum() / batch.num_targets
            self.metric_bag.toy_loss.update(loss.detach())
            return loss, None
        loss = errors.sum()
        self.metric_bag.toy_loss.update(loss.detach() / batch.num_targets, weight=batch.num_targets)
        return loss, batch.num_targets


class PoisonedToyUnit(ToyUnit):
    """A ToyUnit whose loss is multiplied by ``poison`` (NaN or infinity) at some steps on one
    rank, as a bad batch or an fp16 overflow would make it; with ``gradients_only``, the loss
    stays finite and its gradients are NaN instead (the poison's value does not matter then)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        poison: float,
        steps: list[int],
        rank: int,
        my_rank: int,
        gradients_only: bool = False,
    ) -> None:
        super().__init__(model, mean_loss=False, zero_targets=False)
        self._poison = poison if rank == my_rank else 1.0
        self._poisons_here = rank == my_rank
        self._gradients_only = gradients_only
        self._steps = steps
        self._step_nr = 0

    def set_step_nr(self, step_nr: int) -> None:
        self._step_nr = step_nr

    def __call__(self, batch: ToyBatch) -> tuple[Tensor, int | None]:
        loss, num_targets = super().__call__(batch)
        if self._step_nr in self._steps:
            if not self._gradients_only:
                loss = loss * self._poison
            elif self._poisons_here:
                # sqrt at 0: the value 0, an infinite slope, so NaN gradients for a finite loss.
                loss = loss + torch.sqrt(loss * 0.0)
        return loss, num_targets


class ParamSnapshots(TrainerCallback):
    """Rank 0 keeps the full parameters after every step in ``OUTPUT_DIR/snapshots.pt``."""

    def __init__(self, model: nn.Module, rank: int, output_dir: Path) -> None:
        self._model = model
        self._rank = rank
        self._file = output_dir / "snapshots.pt"
        self._by_step: dict[int, dict[str, Tensor]] = {}

    def on_step_end(self, *, step_nr: int, metrics: object = None) -> None:
        state = get_model_state_dict(
            self._model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self._rank == 0:
            self._by_step[step_nr] = {
                k.removeprefix("module."): v.detach().clone() for k, v in state.items()
            }
            torch.save(self._by_step, self._file)


def float64_gradient_norm(model: nn.Module) -> float:
    """The 2-norm of ``model``'s gradients summed in float64, each parameter counted once at its
    full shape (a DTensor's gathered from its shards): the reference a published norm meets."""
    from torch.distributed.tensor import DTensor

    total = 0.0
    for param in model.parameters():
        grad = param.grad
        if grad is not None:
            full = grad.full_tensor() if isinstance(grad, DTensor) else grad
            total += float(full.double().pow(2).sum())
    return total**0.5


class ReferenceNorms(TrainerCallback):
    """Rank 0 writes the :func:`float64_gradient_norm` of each step's gradients, as the optimizer
    gets them, to ``OUTPUT_DIR/reference_norms.json`` (``{step: norm}``)."""

    def __init__(self, rank: int, output_dir: Path) -> None:
        self._rank = rank
        self._file = output_dir / "reference_norms.json"
        self._by_step: dict[int, float] = {}

    def on_before_optimizer_step(self, *, step_nr: int, model: nn.Module) -> None:
        self._by_step[step_nr] = float64_gradient_norm(model)  # a collective: every rank
        if self._rank == 0:
            self._file.write_text(json.dumps(self._by_step))


def make_unit(model: nn.Module, options: dict[str, Any], rank: int) -> ToyUnit:
    poison = options.get("poison")
    if poison is None:
        return ToyUnit(
            model,
            mean_loss=options.get("mean_loss", False),
            zero_targets=options.get("zero_targets", False),
        )
    return PoisonedToyUnit(
        model,
        poison=float(poison),
        steps=options["poison_steps"],
        rank=options.get("poison_rank", 0),
        my_rank=rank,
        gradients_only=options.get("poison_gradients_only", False),
    )


def train(root: Gang, output_dir: Path, options: dict[str, Any]) -> Trainer[ToyBatch]:
    """One run on ``root``'s processes, in the layout of ``options``; returns its Trainer."""
    gangs = setup_parallel_gangs(
        root, tp_size=options.get("tp_size", 1), dp_shard_size=options.get("dp_shard_size")
    )
    torch.manual_seed(0)
    model: nn.Module = ToyModel(hidden_size=options.get("hidden_size", 16))
    model = apply_tensor_parallel(
        model, gangs, {"up": ColwiseParallel(), "down": RowwiseParallel()}
    )
    model = apply_data_parallel(model, gangs, kind=options.get("kind", "ddp"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    reader = MapDataReader(
        dataset=ToyDataset(options.get("dataset_size", 256)),
        batch_size=options["batch_size"],
        collate=collate,
        gang=gangs.dp,
        num_accumulate=options.get("num_accumulate", 1),
        seed=3,
    )
    callbacks = []
    if options.get("snapshots"):
        callbacks.append(ParamSnapshots(model, gangs.root.rank, output_dir))
    if options.get("reference_norms"):
        callbacks.append(ReferenceNorms(gangs.root.rank, output_dir))
    trainer = Trainer(
        unit=make_unit(model, options, gangs.root.rank),
        data_reader=reader,
        optimizer=optimizer,
        checkpoint_manager=CheckpointManager(output_dir / "checkpoints", gangs),
        gangs=gangs,
        max_num_steps=options.get("max_num_steps", 6),
        max_num_data_epochs=options.get("max_num_data_epochs"),
        max_gradient_norm=options.get("max_gradient_norm"),
        publish_metrics_every_n_steps=options.get("publish_every", 2),
        metrics_dir=output_dir / "metrics",
        checkpoint_every_n_steps=options.get("checkpoint_every"),
        dtype=getattr(torch, options.get("dtype", "float32")),
        fp16_loss_scale=tuple(options.get("fp16_loss_scale", (128.0, 0.0001))),
        nan_policy=options.get("nan_policy", "error"),
        max_consecutive_skipped_steps=options.get("max_consecutive_skipped_steps", 10),
        callbacks=callbacks,
        progress=False,
    )
    trainer.run()

    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if gangs.root.rank == 0:
        torch.save(
            {k.removeprefix("module."): v for k, v in state.items()}, output_dir / "params.pt"
        )
    return trainer


def run_all(root: Gang, output_dir: Path, runs: dict[str, dict[str, Any]]) -> None:
    """Each of ``runs`` in turn into ``output_dir/NAME``; the torch path is left as found."""
    previous = os.environ.get(PRIVATE_APIS_ENV_VAR)
    for name, run_options in runs.items():
        if "torch_path" in run_options:
            os.environ[PRIVATE_APIS_ENV_VAR] = run_options["torch_path"]
        (output_dir / name).mkdir(parents=True, exist_ok=True)
        try:
            train(root, output_dir / name, run_options).close()
        except BaseException as ex:
            ex.add_note(f"(in train_toy.py's run {name})")
            raise
    if previous is None:
        os.environ.pop(PRIVATE_APIS_ENV_VAR, None)
    else:
        os.environ[PRIVATE_APIS_ENV_VAR] = previous


def main(output_dir: Path, options: dict[str, Any]) -> None:
    root = setup_root_gang()
    if "runs" not in options:
        leave(root, train(root, output_dir, options))
    run_all(root, output_dir, options["runs"])
    leave(root)


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
