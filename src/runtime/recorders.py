"""Where published metrics go: a log line, JSONL files, TensorBoard and Weights & Biases.

Each recorder takes the values of one *run* (``train``, ``valid``, ``valid/<name>``, ``eval``) at
one step. The Trainer builds them on rank 0 only: the values it publishes are already reduced
over the data-parallel gang, so one writer is enough.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, final

from typing_extensions import override

from checkpoint.durable import write_text_atomically
from gangs import Gang


class MetricRecorder(ABC):
    """Records the values of a run at a step."""

    @abstractmethod
    def record_metrics(self, run: str, values: Mapping[str, Any], step_nr: int) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Flush and release files; the recorder is unusable afterwards."""


@final
class CompositeMetricRecorder(MetricRecorder):
    """Hands the values to each of ``recorders`` in order."""

    def __init__(self, recorders: Sequence[MetricRecorder]) -> None:
        self._recorders = list(recorders)

    @override
    def record_metrics(self, run: str, values: Mapping[str, Any], step_nr: int) -> None:
        for recorder in self._recorders:
            recorder.record_metrics(run, values, step_nr)

    @override
    def close(self) -> None:
        for recorder in self._recorders:
            recorder.close()


@final
class LogMetricRecorder(MetricRecorder):
    """One line per publish: ``train step 100: loss 2.31 | lr 0.003 | ...``."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger

    @override
    def record_metrics(self, run: str, values: Mapping[str, Any], step_nr: int) -> None:
        text = " | ".join(f"{name} {_format(value)}" for name, value in sorted(values.items()))
        self._logger.info("%s step %d: %s", run, step_nr, text)

    @override
    def close(self) -> None:
        pass


@final
class JsonlMetricRecorder(MetricRecorder):
    """Appends ``{"step_nr": N, ...}`` to ``output_dir/<run>.jsonl``, one object per publish.

    ``valid/<name>`` goes to ``valid/<name>.jsonl``. Each line is flushed as it is written, so a
    killed run loses no published values; non-finite floats are written as ``null`` to keep the
    files strict JSON.
    """

    def __init__(self, output_dir: Path) -> None:
        self._output_dir = Path(output_dir)
        self._files: dict[str, Any] = {}

    @override
    def record_metrics(self, run: str, values: Mapping[str, Any], step_nr: int) -> None:
        file = self._files.get(run)
        if file is None:
            path = self._output_dir / f"{run}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            file = self._files[run] = path.open("a", encoding="utf-8")
        record: dict[str, Any] = {"step_nr": step_nr}
        record.update({name: _to_json(value) for name, value in values.items()})
        file.write(json.dumps(record, allow_nan=False) + "\n")
        file.flush()

    @override
    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()


@final
class TensorBoardRecorder(MetricRecorder):
    """Writes scalars to TensorBoard event files under ``output_dir/<run>``."""

    def __init__(self, output_dir: Path) -> None:
        self._output_dir = Path(output_dir)
        self._writers: dict[str, Any] = {}

    @override
    def record_metrics(self, run: str, values: Mapping[str, Any], step_nr: int) -> None:
        writer = self._writers.get(run)
        if writer is None:
            # Imported here: torch.utils.tensorboard pulls in tensorboard, slow to import.
            from torch.utils.tensorboard import SummaryWriter

            writer = self._writers[run] = SummaryWriter(str(self._output_dir / run))
        for name, value in values.items():
            if _is_number(value):
                writer.add_scalar(name, float(value), step_nr)
        writer.flush()

    @override
    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()


@final
class WandbRecorder(MetricRecorder):
    """Logs to a Weights & Biases run whose files are in ``output_dir/wandb``.

    The run id is kept in ``output_dir/wandb/run_id``, so a resumed training continues the same
    W&B run instead of starting a new one. ``WANDB_MODE=offline`` works as usual. The run starts
    at the first values recorded: a Trainer that never publishes (or fails to build) starts none.
    """

    def __init__(
        self,
        *,
        project: str,
        output_dir: Path,
        run_name: str | None = None,
        config: Mapping[str, object] | None = None,
    ) -> None:
        self._project = project
        self._output_dir = Path(output_dir)
        self._run_name = run_name
        self._config = dict(config) if config is not None else None
        self._run: Any = None

    @property
    def run_id(self) -> str:
        return str(self._started_run().id)

    @override
    def record_metrics(self, run: str, values: Mapping[str, Any], step_nr: int) -> None:
        scalars = {f"{run}/{name}": float(v) for name, v in values.items() if _is_number(v)}
        self._started_run().log(scalars, step=step_nr)

    @override
    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None

    def _started_run(self) -> Any:
        if self._run is None:
            # Imported here: wandb takes about a second to import.
            import wandb

            wandb_dir = self._output_dir / "wandb"
            wandb_dir.mkdir(parents=True, exist_ok=True)
            id_file = wandb_dir / "run_id"
            run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
            self._run = wandb.init(
                project=self._project,
                name=self._run_name,
                id=run_id,
                resume="allow",
                dir=str(self._output_dir),
                config=self._config,
            )
            write_text_atomically(id_file, run_id)
        return self._run


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real)


def _to_json(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if _is_number(value):
        number = float(value)
        return number if math.isfinite(number) else None
    if hasattr(value, "tolist"):
        return _to_json(value.tolist())
    if isinstance(value, list | tuple):
        return [_to_json(item) for item in value]
    return str(value)


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


@dataclass(frozen=True)
class WandbOptions:
    """The Trainer's ``wandb_*`` arguments; no ``project``, no W&B."""

    project: str | None = None
    run_name: str | None = None
    output_dir: Path | None = None
    config: Mapping[str, object] | None = None


def make_recorder(
    gang: Gang,
    *,
    metrics_dir: Path | None = None,
    tb_dir: Path | None = None,
    wandb: WandbOptions = WandbOptions(),
) -> MetricRecorder:
    """The recorders a Trainer writes to: on rank 0 of ``gang``, a log line and each one
    configured; on the others, none (the values they would write are synced already)."""
    recorders: list[MetricRecorder] = []
    if gang.rank == 0:
        recorders.append(LogMetricRecorder(logging.getLogger("runtime.trainer")))
        if metrics_dir is not None:
            recorders.append(JsonlMetricRecorder(metrics_dir))
        if tb_dir is not None:
            recorders.append(TensorBoardRecorder(tb_dir))
        if wandb.project is not None:
            wandb_base = wandb.output_dir or metrics_dir or tb_dir
            if wandb_base is None:
                raise ValueError("wandb_project needs wandb_dir (or metrics_dir) for its files.")
            recorders.append(
                WandbRecorder(
                    project=wandb.project,
                    output_dir=wandb_base,
                    run_name=wandb.run_name,
                    config=wandb.config,
                )
            )
    return CompositeMetricRecorder(recorders)
