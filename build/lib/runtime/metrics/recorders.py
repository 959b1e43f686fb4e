"""Where published metrics go: a log line, JSONL, CSV, TensorBoard, Weights & Biases, or yours.

Each recorder takes the values of one *run* (``train``, ``valid``, ``valid/<name>``, ``eval``) at
one step. The Trainer records on rank 0 only: the values it publishes are already reduced over the
data-parallel gang, so one writer is enough. It closes its recorders on every rank when it ends.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import numbers
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, final

from typing_extensions import override

from gangs import Gang
from trainkit_utils.files import write_text_atomically


class MetricRecorder(ABC):
    """Records the values of a run at a step; subclass it to send metrics anywhere.

    ``values`` maps metric names to numbers (Python or 0-d tensors' items) and, rarely, strings.
    """

    @abstractmethod
    def record(self, run: str, step_nr: int, values: Mapping[str, Any]) -> None:
        """Record ``values`` of ``run`` (``train``, ``valid``, ``valid/<name>``, ``eval``)."""

    @abstractmethod
    def close(self) -> None:
        """Flush and release files and connections; called once at the end of the training."""


@final
class CompositeMetricRecorder(MetricRecorder):
    """Hands the values to each of ``recorders`` in order."""

    def __init__(self, recorders: Sequence[MetricRecorder]) -> None:
        self._recorders = list(recorders)

    @override
    def record(self, run: str, step_nr: int, values: Mapping[str, Any]) -> None:
        for recorder in self._recorders:
            recorder.record(run, step_nr, values)

    @override
    def close(self) -> None:
        close_all(self._recorders)


def close_all(recorders: Sequence[MetricRecorder]) -> None:
    """Close every recorder, even after one failed to; then raise the first failure."""
    errors: list[Exception] = []
    for recorder in recorders:
        try:
            recorder.close()
        except Exception as ex:
            errors.append(ex)
    if errors:
        raise errors[0]


@final
class LogMetricRecorder(MetricRecorder):
    """One line per publish: ``train step 100: loss 2.31 | lr 0.003 | ...``."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger

    @override
    def record(self, run: str, step_nr: int, values: Mapping[str, Any]) -> None:
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
    def record(self, run: str, step_nr: int, values: Mapping[str, Any]) -> None:
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
class CsvMetricRecorder(MetricRecorder):
    """Writes ``output_dir/<run>.csv``: a ``step_nr`` column, then one column per metric.

    The header comes from the first record of a run (its names sorted); a resumed run appends
    to the file it finds, under that file's header. A record with a metric the header lacks
    rewrites the file once with the new columns appended at the end (the earlier rows leave
    them empty), so every row of the file has the same columns; a record without some metric
    leaves its cell empty. Each row is flushed as it is written, and a rewrite replaces the
    file in one atomic rename, so a killed run leaves a readable file with every published row.
    Non-finite floats are written as ``nan``, ``inf`` and ``-inf``, which CSV readers parse.
    """

    def __init__(self, output_dir: Path) -> None:
        self._output_dir = Path(output_dir)
        self._files: dict[str, tuple[IO[str], list[str]]] = {}

    @override
    def record(self, run: str, step_nr: int, values: Mapping[str, Any]) -> None:
        file, header = self._files.get(run) or self._open(run, values)
        new_names = sorted(set(values) - set(header))
        if new_names:
            file, header = self._extend_header(run, file, header + new_names)
        row = {"step_nr": step_nr} | {name: _to_cell(value) for name, value in values.items()}
        file.write(_csv_line([row.get(name, "") for name in header]))
        file.flush()

    def _path(self, run: str) -> Path:
        return self._output_dir / f"{run}.csv"

    def _open(self, run: str, values: Mapping[str, Any]) -> tuple[IO[str], list[str]]:
        path = self._path(run)
        path.parent.mkdir(parents=True, exist_ok=True)
        header = _read_header(path)
        file = path.open("a", encoding="utf-8", newline="")
        if header is None:
            header = ["step_nr", *sorted(values)]
            file.write(_csv_line(header))
        self._files[run] = (file, header)
        return file, header

    def _extend_header(
        self, run: str, file: IO[str], header: list[str]
    ) -> tuple[IO[str], list[str]]:
        file.close()
        path = self._path(run)
        with path.open(encoding="utf-8", newline="") as old:
            rows = list(csv.reader(old))[1:]
        width = len(header)
        lines = [_csv_line(header)]
        lines.extend(_csv_line(row + [""] * (width - len(row))) for row in rows)
        write_text_atomically(path, "".join(lines))
        file = path.open("a", encoding="utf-8", newline="")
        self._files[run] = (file, header)
        return file, header

    @override
    def close(self) -> None:
        for file, _ in self._files.values():
            file.close()
        self._files.clear()


def _read_header(path: Path) -> list[str] | None:
    """The header row of an existing CSV file, None for a missing or empty one."""
    if not path.is_file():
        return None
    with path.open(encoding="utf-8", newline="") as file:
        return next(csv.reader(file), None)


def _csv_line(cells: Sequence[object]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(cells)
    return buffer.getvalue()


def _to_cell(value: Any) -> object:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float):
        return repr(value)  # every digit, and nan/inf as CSV readers parse them
    return value


@final
class TensorBoardRecorder(MetricRecorder):
    """Writes scalars to TensorBoard event files under ``output_dir/<run>``."""

    def __init__(self, output_dir: Path) -> None:
        self._output_dir = Path(output_dir)
        self._writers: dict[str, Any] = {}

    @override
    def record(self, run: str, step_nr: int, values: Mapping[str, Any]) -> None:
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
        self._finished = False

    @property
    def run_id(self) -> str:
        return str(self._started_run().id)

    @override
    def record(self, run: str, step_nr: int, values: Mapping[str, Any]) -> None:
        scalars = {f"{run}/{name}": float(v) for name, v in values.items() if _is_number(v)}
        self._started_run().log(scalars, step=step_nr)

    @override
    def close(self) -> None:
        if self._run is not None and not self._finished:
            self._run.finish()
            self._finished = True

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
class RecorderOptions:
    """The Trainer's shorthands for the built-in recorders: ``tb_dir``, ``metrics_dir`` (JSONL)
    and ``wandb_*`` (no ``wandb_project``, no W&B)."""

    tb_dir: Path | None = None
    metrics_dir: Path | None = None
    wandb_project: str | None = None
    wandb_run_name: str | None = None
    wandb_dir: Path | None = None
    wandb_config: Mapping[str, object] | None = None

    def __post_init__(self) -> None:
        if self.wandb_project is not None and self._wandb_base is None:
            raise ValueError("wandb_project needs wandb_dir (or metrics_dir) for its files.")

    @property
    def _wandb_base(self) -> Path | None:
        return self.wandb_dir or self.metrics_dir or self.tb_dir

    def build(self) -> list[MetricRecorder]:
        """The recorders these options name."""
        recorders: list[MetricRecorder] = []
        if self.metrics_dir is not None:
            recorders.append(JsonlMetricRecorder(self.metrics_dir))
        if self.tb_dir is not None:
            recorders.append(TensorBoardRecorder(self.tb_dir))
        if self.wandb_project is not None and self._wandb_base is not None:
            recorders.append(
                WandbRecorder(
                    project=self.wandb_project,
                    output_dir=self._wandb_base,
                    run_name=self.wandb_run_name,
                    config=self.wandb_config,
                )
            )
        return recorders


def make_recorder(
    gang: Gang, recorders: Sequence[MetricRecorder], options: RecorderOptions
) -> MetricRecorder:
    """What a Trainer records to: on rank 0 of ``gang``, a log line, the built-ins ``options``
    name and ``recorders``; on the other ranks nothing (the values are synced already), but
    closing it closes ``recorders`` there too, since every rank built its own."""
    if gang.rank != 0:
        return _ClosingOnly(recorders)
    log_line = LogMetricRecorder(logging.getLogger(__name__))
    return CompositeMetricRecorder([log_line, *options.build(), *recorders])


@final
class _ClosingOnly(MetricRecorder):
    def __init__(self, recorders: Sequence[MetricRecorder]) -> None:
        self._recorders = list(recorders)

    @override
    def record(self, run: str, step_nr: int, values: Mapping[str, Any]) -> None:
        pass

    @override
    def close(self) -> None:
        close_all(self._recorders)
