"""The toy run of ``train_toy.py`` as a recipe, with hooks to interrupt it, for the resume tests.

Usage: ``torchrun ... tests/workers/resume_toy.py OUTPUT_DIR [--config key=value]...``. It goes
through ``runtime.main`` like a real recipe, so ``OUTPUT_DIR/logs/rank_N.log`` and the exit status
are what users get. A run that finishes writes the full parameters to ``OUTPUT_DIR/params.pt``.

With ``reference_first=true`` the process first trains the same run without faults, from scratch
and to the end, in ``OUTPUT_DIR/reference`` (one launch instead of two on a small machine).

Faults, each on rank ``fault_rank`` (``-1``: the last rank) only:

- ``sigterm_at_step``: the rank sends SIGTERM to itself after that step;
- ``wait_for_sigterm_at_step``: after that step every rank writes ``OUTPUT_DIR/ready/rank_R`` and
  waits until a SIGTERM from outside (to ``torchrun``) arrives;
- ``sigkill_at_step``: the rank SIGKILLs itself after that step;
- ``sigkill_in_save``: ``"after_model"`` (the model of step ``sigkill_save_step`` is written, the
  rest of the save not) or ``"after_manifest"`` (the manifest is written, the rename not);
- ``raise_at_step``: the rank raises after that step, on the first torchrun attempt only;
- ``hang_at_step``: after that step the rank sleeps for good, calling no more collectives.

Pacing, for tests that strike at random moments (on every rank):

- ``step_sleep``: seconds to sleep after each step;
- ``save_sleep``: seconds to sleep before and after each DCP write of a save and before its
  manifest is written, so that a save lasts long enough to be hit;
- ``valid_sleep``: seconds each validation batch takes (validation runs with ``validate_every``);
- ``mark_steps``: write ``OUTPUT_DIR/progress/step_N`` after each step (rank 0), for a test to
  wait on.

``hidden_size`` changes the model shape and ``gang_timeout_seconds`` the collective timeout.

With ``save_initial_params=true`` the run also writes the parameters its first step starts from
to ``OUTPUT_DIR/initial_params.pt`` (to check ``init_from``).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, final

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import checkpoint.manifest as manifest_module
from checkpoint import CheckpointManager
from gangs import Gangs, setup_gangs
from runtime import (
    MapDataReader,
    Trainer,
    TrainerCallback,
    apply_data_parallel,
    apply_tensor_parallel,
    main,
)
from tests.workers.train_toy import ToyBatch, ToyDataset, ToyModel, ToyUnit, collate
from tests.workers.valid_toy import ToyEvalUnit, make_valid_reader


@dataclass
class ResumeToyConfig:
    batch_size: int = 8
    dataset_size: int = 40
    max_num_steps: int = 10
    tp_size: int = 1
    dp_shard_size: int | None = None
    kind: Literal["ddp", "fsdp", "hsdp"] = "ddp"
    init_from: Path | None = None
    save_initial_params: bool = False
    checkpoint_every: int | None = 2
    publish_every: int = 2
    async_checkpoint: bool = False
    reshard_on_resume: bool = False
    fault_rank: int = -1
    sigterm_at_step: int | None = None
    wait_for_sigterm_at_step: int | None = None
    sigkill_at_step: int | None = None
    sigkill_in_save: Literal["after_model", "after_manifest"] | None = None
    sigkill_save_step: int | None = None
    raise_at_step: int | None = None
    hang_at_step: int | None = None
    step_sleep: float = 0.0
    save_sleep: float = 0.0
    valid_sleep: float = 0.0
    validate_every: int | None = None
    mark_steps: bool = False
    hidden_size: int = 16
    gang_timeout_seconds: float = 900.0
    reference_first: bool = False


@final
class _Faults(TrainerCallback):
    def __init__(self, config: ResumeToyConfig, gangs: Gangs, output_dir: Path) -> None:
        self._config = config
        self._output_dir = output_dir
        self._rank = gangs.root.rank
        fault_rank = config.fault_rank if config.fault_rank >= 0 else gangs.root.size - 1
        self._is_fault_rank = self._rank == fault_rank
        self.trainer: Trainer[Any] | None = None

    def on_step_end(self, *, step_nr: int, metrics: object = None) -> None:
        config = self._config
        if config.step_sleep:
            time.sleep(config.step_sleep)
        if config.mark_steps and self._rank == 0:
            progress = self._output_dir / "progress"
            progress.mkdir(exist_ok=True)
            (progress / f"step_{step_nr}").touch()
        if step_nr == config.wait_for_sigterm_at_step:
            self._wait_for_sigterm()
        if not self._is_fault_rank:
            return
        if step_nr == config.hang_at_step:
            self._hang(step_nr)
        if step_nr == config.sigterm_at_step:
            os.kill(os.getpid(), signal.SIGTERM)
        if step_nr == config.sigkill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if step_nr == config.raise_at_step and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            raise RuntimeError(f"Injected failure at step {step_nr} on rank {self._rank}.")

    def _hang(self, step_nr: int) -> None:
        logging.getLogger(__name__).warning("Hanging after step %d on purpose.", step_nr)
        assert self.trainer is not None
        # Stuck, but not deaf: the launcher's SIGTERM ends it at once instead of 30 s later.
        while not self.trainer.stop_requested:
            time.sleep(0.1)
        raise SystemExit(1)  # ended by the launcher's SIGTERM, without a step boundary

    def _wait_for_sigterm(self) -> None:
        ready = self._output_dir / "ready"
        ready.mkdir(exist_ok=True)
        (ready / f"rank_{self._rank}").touch()
        deadline = time.monotonic() + 60
        assert self.trainer is not None
        while not self.trainer.stop_requested:
            if time.monotonic() > deadline:
                raise RuntimeError("No SIGTERM arrived within 60 seconds.")
            time.sleep(0.01)

    def slow_down_saves(self, manager: CheckpointManager) -> None:
        """Sleep ``save_sleep`` around each DCP write and before each manifest write."""
        pause = self._config.save_sleep
        if not pause:
            return
        storage = manager._storage
        dcp_save, dcp_async_save = storage.save, storage.async_save

        def slow_save(state: dict[str, Any], path: Path) -> Any:
            time.sleep(pause)
            digests = dcp_save(state, path)
            time.sleep(pause)
            return digests

        def slow_async_save(state: dict[str, Any], path: Path, *, writer_nr: int) -> Any:
            time.sleep(pause)
            return dcp_async_save(state, path, writer_nr=writer_nr)

        storage.save = slow_save  # type: ignore[method-assign]
        storage.async_save = slow_async_save  # type: ignore[method-assign]
        write_json = manifest_module.write_json_durably

        def slow_write_json(obj: Any, file: Path) -> None:
            time.sleep(pause)
            write_json(obj, file)

        manifest_module.write_json_durably = slow_write_json  # type: ignore[assignment]

    def install_save_faults(self, manager: CheckpointManager) -> None:
        """SIGKILL this rank midway through the save of ``sigkill_save_step``."""
        config = self._config
        if config.sigkill_in_save is None or not self._is_fault_rank:
            return
        target = manager.checkpoint_dir / f"step_{config.sigkill_save_step}.tmp"
        if config.sigkill_in_save == "after_model":
            storage = manager._storage
            dcp_save = storage.save

            def save_then_die(state: dict[str, Any], path: Path) -> Any:
                digests = dcp_save(state, path)
                if path == target / "model":
                    os.kill(os.getpid(), signal.SIGKILL)
                return digests

            storage.save = save_then_die  # type: ignore[method-assign]
        else:
            write_json = manifest_module.write_json_durably

            def write_then_die(obj: Any, file: Path) -> None:
                write_json(obj, file)
                if file == target / "manifest.json":
                    os.kill(os.getpid(), signal.SIGKILL)

            manifest_module.write_json_durably = write_then_die  # type: ignore[assignment]


def save_full_params(model: nn.Module, gangs: Gangs, file: Path) -> None:
    """Gather the full parameters (every rank must call it); rank 0 writes them to ``file``."""
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if gangs.root.rank == 0:
        torch.save({k.removeprefix("module."): v for k, v in state.items()}, file)


@final
class _SaveInitialParams(TrainerCallback):
    """Writes the parameters the first step starts from (after a resume or ``init_from``)."""

    def __init__(self, model: nn.Module, gangs: Gangs, file: Path) -> None:
        self._model = model
        self._gangs = gangs
        self._file = file

    def on_train_begin(self, *, step_nr: int) -> None:
        save_full_params(self._model, self._gangs, self._file)


@final
class _SlowEvalUnit(ToyEvalUnit):
    """The toy validation, ``pause`` seconds a batch: a window for signals during validation."""

    def __init__(self, model: nn.Module, *, pause: float) -> None:
        super().__init__(model)
        self._pause = pause

    def __call__(self, batch: ToyBatch) -> None:
        time.sleep(self._pause)
        super().__call__(batch)


@final
class _ToyRun:
    def __init__(
        self, config: ResumeToyConfig, gangs: Gangs, output_dir: Path, *, faults: bool
    ) -> None:
        self._gangs = gangs
        self._output_dir = output_dir
        self._trainer, self._model = _build(config, gangs, output_dir, faults=faults)
        self._reference: _ToyRun | None = None
        if config.reference_first and faults:
            self._reference = _ToyRun(config, gangs, output_dir / "reference", faults=False)

    @property
    def step_nr(self) -> int:
        return self._trainer.step_nr

    def run(self) -> int:
        if self._reference is not None and self._reference.run() != 0:
            raise RuntimeError("The reference run did not finish.")
        code = self._trainer.run()
        if code == 0:
            save_full_params(self._model, self._gangs, self._output_dir / "params.pt")
        return code


def recipe(config: ResumeToyConfig, output_dir: Path) -> _ToyRun:
    gangs = setup_gangs(
        tp_size=config.tp_size,
        dp_shard_size=config.dp_shard_size,
        timeout=timedelta(seconds=config.gang_timeout_seconds),
    )
    return _ToyRun(config, gangs, output_dir, faults=True)


def _build(
    config: ResumeToyConfig, gangs: Gangs, output_dir: Path, *, faults: bool
) -> tuple[Trainer[Any], nn.Module]:
    torch.manual_seed(0)
    model: nn.Module = ToyModel(hidden_size=config.hidden_size)
    model = apply_tensor_parallel(
        model, gangs, {"up": ColwiseParallel(), "down": RowwiseParallel()}
    )
    model = apply_data_parallel(model, gangs, kind=config.kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    reader = MapDataReader(
        dataset=ToyDataset(config.dataset_size),
        batch_size=config.batch_size,
        collate=collate,
        gang=gangs.dp,
        seed=3,
    )
    manager = CheckpointManager(output_dir / "checkpoints", gangs)
    callbacks: list[TrainerCallback] = []
    if config.save_initial_params:
        callbacks.append(_SaveInitialParams(model, gangs, output_dir / "initial_params.pt"))
    if faults:
        fault_injector = _Faults(config, gangs, output_dir)
        fault_injector.slow_down_saves(manager)
        fault_injector.install_save_faults(manager)
        callbacks.append(fault_injector)
    validation: dict[str, Any] = {}
    if config.validate_every is not None:
        validation = {
            "valid_units": [_SlowEvalUnit(model, pause=config.valid_sleep)],
            "valid_data_readers": [make_valid_reader(gangs.dp, size=8)],
            "validate_every_n_steps": config.validate_every,
        }
    trainer = Trainer(
        unit=ToyUnit(model, mean_loss=False, zero_targets=False),
        data_reader=reader,
        optimizer=optimizer,
        checkpoint_manager=manager,
        gangs=gangs,
        lr_scheduler=lr_scheduler,
        max_num_steps=config.max_num_steps,
        max_gradient_norm=0.5,
        publish_metrics_every_n_steps=config.publish_every,
        metrics_dir=output_dir / "metrics",
        checkpoint_every_n_steps=config.checkpoint_every,
        async_checkpoint=config.async_checkpoint,
        reshard_on_resume=config.reshard_on_resume,
        callbacks=callbacks,
        progress=False,
        init_from=config.init_from,
        **validation,
    )
    if faults:
        fault_injector.trainer = trainer
    return trainer, model


if __name__ == "__main__":
    main(recipe, ResumeToyConfig)
