"""A tiny recipe for the command-line tests: no model, just enough to exercise ``runtime.main``.

Runs as ``python -m tests.runtime.cli.cli_recipe OUT ...`` and as ``torchrun tests/runtime/cli/cli_recipe.py``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, final

import torch
import torch.distributed as dist

from gangs import setup_root_gang
from runtime import main

log = logging.getLogger(__name__)


@dataclass
class GangSection:
    tp_size: int = 1


@dataclass
class CliRecipeConfig:
    gang: GangSection = field(default_factory=GangSection)
    max_num_steps: int = 3
    lr: float = 1e-3
    data_dir: Path | None = None
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    betas: tuple[float, float] = (0.9, 0.95)
    fail_in_run: bool = False
    fail_on_rank: int | None = None
    """This rank alone rejects the config while the recipe builds, before the process group."""
    exit_code: int = 0

    def validate(self) -> None:
        if self.gang.tp_size < 1:
            raise ValueError(f"gang.tp_size must be at least 1, but is {self.gang.tp_size}.")


@final
class FakeTrainer:
    def __init__(self, *, config: CliRecipeConfig) -> None:
        self._config = config

    def run(self) -> int:
        if dist.is_initialized():
            # A collective proves the ranks really share a process group.
            total = torch.ones(1)
            dist.all_reduce(total)
            log.info("All-reduced over %d ranks.", int(total.item()))
        log.info(
            "Fake training for %d steps at lr %s.", self._config.max_num_steps, self._config.lr
        )
        if self._config.fail_in_run:
            raise RuntimeError("Fake failure inside run().")
        return self._config.exit_code


def recipe(config: CliRecipeConfig, output_dir: Path) -> FakeTrainer:
    if config.max_num_steps <= 0:
        # Worded like the real Trainer's check, which runs while the recipe builds it.
        raise ValueError(
            f"max_num_steps must be greater than zero, but is {config.max_num_steps} instead."
        )
    if config.fail_on_rank == int(os.environ.get("RANK", "0")):
        raise ValueError(f"data_dir {config.data_dir} is not readable on this rank.")
    setup_root_gang(device=torch.device("cpu"))
    return FakeTrainer(config=config)


if __name__ == "__main__":
    main(recipe, CliRecipeConfig)
