"""A toy run with part of its model frozen, under ``torchrun``, in each layout of ``KINDS``.

Usage: ``frozen_params.py OUTPUT_DIR JSON_OPTIONS`` (``kinds``: ``ddp``, ``fsdp``, ``hsdp``, ``tp``;
``tp_size``, ``dp_shard_size``). Per kind, trains 4 steps and checkpoints, then builds the model
again from other random weights and resumes to step 6. Rank 0 writes ``OUTPUT_DIR/KIND/report.pt``:
the frozen weights built and after training, the frozen weights the resume found, the gradient
norm computed here over the trainable parameters at each step, and whether any frozen parameter
had a gradient.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from checkpoint import CheckpointManager
from gangs import Gangs, setup_gangs
from runtime import (
    MapDataReader,
    Trainer,
    TrainerCallback,
    apply_data_parallel,
    apply_tensor_parallel,
)
from tests.workers.leave import leave
from tests.workers.train_toy import ToyDataset, ToyModel, ToyUnit, collate

# The layer norm wholly, and the weight of ``up`` beside its trainable bias (one FSDP unit).
FROZEN = ("norm.weight", "norm.bias", "up.weight")


def full_state(model: nn.Module) -> dict[str, Tensor]:
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {k.removeprefix("module."): v.detach().clone() for k, v in state.items()}


class GradientCheck(TrainerCallback):
    """The 2-norm of the trainable parameters' full gradients before each optimizer step, and
    whether a frozen parameter has a gradient."""

    def __init__(self) -> None:
        self.norms: dict[int, float] = {}
        self.frozen_with_grad: list[str] = []

    def on_before_optimizer_step(self, *, step_nr: int, model: nn.Module) -> None:
        squares = torch.zeros((), dtype=torch.float64)
        for name, param in model.named_parameters():
            if not param.requires_grad:
                if param.grad is not None:
                    self.frozen_with_grad.append(name)
                continue
            assert param.grad is not None, name
            grad = param.grad
            full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            squares += full.double().pow(2).sum()
        self.norms[step_nr] = squares.sqrt().item()


class FrozenAtStart(TrainerCallback):
    """The frozen parameters when training begins: what the resume left in them."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self.state: dict[str, Tensor] = {}

    def on_train_begin(self, *, step_nr: int) -> None:
        self.state = {k: v for k, v in full_state(self._model).items() if k in FROZEN}


def build(kind: str, gangs: Gangs, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model: nn.Module = ToyModel()
    for name, param in model.named_parameters():
        param.requires_grad_(name not in FROZEN)
    model = apply_tensor_parallel(
        model, gangs, {"up": ColwiseParallel(), "down": RowwiseParallel()}
    )
    # "tp": tensor parallelism alone (a DP gang of one, where data parallelism is a no-op).
    dp_kind = "fsdp" if kind == "tp" else kind
    return apply_data_parallel(model, gangs, kind=dp_kind, fsdp_units=(nn.Linear,))  # type: ignore[arg-type]


def train(
    kind: str, gangs: Gangs, out: Path, *, seed: int, max_num_steps: int
) -> tuple[nn.Module, Trainer[Any], list[TrainerCallback]]:
    model = build(kind, gangs, seed)
    callbacks: list[TrainerCallback] = [GradientCheck(), FrozenAtStart(model)]
    trainer = Trainer(
        unit=ToyUnit(model, mean_loss=False, zero_targets=False),
        data_reader=MapDataReader(
            dataset=ToyDataset(128), batch_size=4, collate=collate, gang=gangs.dp, seed=3
        ),
        # All parameters, frozen ones too, as users often pass them.
        optimizer=torch.optim.AdamW(model.parameters(), lr=0.05),
        checkpoint_manager=CheckpointManager(out / "checkpoints", gangs),
        gangs=gangs,
        max_num_steps=max_num_steps,
        checkpoint_every_n_steps=4,
        publish_metrics_every_n_steps=1,
        metrics_dir=out / "metrics",
        callbacks=callbacks,
        progress=False,
    )
    trainer.run()
    return model, trainer, callbacks


def main(output_dir: Path, options: dict[str, Any]) -> None:
    gangs = setup_gangs(
        tp_size=options.get("tp_size", 1), dp_shard_size=options.get("dp_shard_size")
    )
    trainers = []
    for kind in options["kinds"]:
        out = output_dir / kind
        built = full_state(build(kind, gangs, seed=0))
        model, trainer, (check, _) = train(kind, gangs, out, seed=0, max_num_steps=4)
        trained = full_state(model)
        # Other random weights: the frozen ones must come back from the checkpoint.
        _, resumed, (resumed_check, at_start) = train(kind, gangs, out, seed=1, max_num_steps=6)
        trainers += [trainer, resumed]
        assert isinstance(check, GradientCheck) and isinstance(resumed_check, GradientCheck)
        assert isinstance(at_start, FrozenAtStart)
        if gangs.root.rank == 0:
            report = {
                "built": {k: built[k] for k in FROZEN},
                "trained": {k: trained[k] for k in FROZEN},
                "resumed": at_start.state,
                "norms": check.norms | resumed_check.norms,
                "frozen_with_grad": check.frozen_with_grad + resumed_check.frozen_with_grad,
            }
            torch.save(report, out / "report.pt")
    leave(gangs.root, *trainers)


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
