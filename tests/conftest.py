"""Shared fixtures: real ``torchrun`` launches and small helpers for reading run output."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, final

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from checkpoint import CheckpointManager
from gangs import Gang, Gangs, ReduceOperation, setup_gangs
from runtime import MapDataReader, MetricRecorder, Trainer
from tests.workers.train_toy import ToyBatch, ToyDataset, ToyModel, ToyUnit, collate
from units import TrainUnit

REPO_ROOT = Path(__file__).resolve().parents[1]


class ListRecorder(MetricRecorder):
    """Keeps every record as ``(run, values, step_nr)``, and whether it was closed."""

    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any], int]] = []
        self.num_closes = 0

    def record(self, run: str, step_nr: int, values: Mapping[str, Any]) -> None:
        self.records.append((run, dict(values), step_nr))

    def close(self) -> None:
        self.num_closes += 1

    @property
    def closed(self) -> bool:
        return self.num_closes > 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for child processes: the repo root importable, W&B offline, quiet threads."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), str(REPO_ROOT / "src"), env.get("PYTHONPATH", "")]
    )
    env.setdefault("WANDB_MODE", "offline")
    env["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    if extra:
        env.update(extra)
    return env


def torchrun_command(nproc: int, target: Sequence[str], *, max_restarts: int = 0) -> list[str]:
    """``python -m torch.distributed.run`` on a free local port, for ``nproc`` processes."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--nnodes=1",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-backend=c10d",
        f"--max-restarts={max_restarts}",
        *target,
    ]


def torchrun(
    nproc: int,
    *target: str,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    max_restarts: int = 0,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``torchrun`` with ``nproc`` processes on a script or ``-m module`` and its arguments.

    Returns the completed process; asserts nothing, so tests can check failing runs too.
    """
    return subprocess.run(
        torchrun_command(nproc, target, max_restarts=max_restarts),
        env=child_env(env),
        cwd=cwd or REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


RunTorch = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run_torchrun() -> RunTorch:
    """:func:`torchrun`, as a fixture."""
    return torchrun


def assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    """Fail with the child's output when it did not exit 0."""
    assert result.returncode == 0, (
        f"exit {result.returncode}\n--- stdout ---\n{result.stdout[-6000:]}"
        f"\n--- stderr ---\n{result.stderr[-6000:]}"
    )


def run_python(
    *args: str, cwd: Path = REPO_ROOT, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` as one process, in :func:`child_env`; asserts nothing."""
    return subprocess.run(
        [sys.executable, *args],
        env=child_env(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def in_process(
    command: Callable[[Sequence[str]], int | None], argv: Sequence[str]
) -> subprocess.CompletedProcess[str]:
    """``command(argv)``, a command line's main, in this process: the exit status (its return
    value, or the code of the ``SystemExit`` it raised), stdout and stderr its process would
    give, without the process's start-up (most of it importing torch). Any other exception
    propagates.

    It computes on one thread, as :func:`child_env` makes child processes do, so its weights
    are bit-identical to those of the same run in a child process.
    """
    stdout, stderr = io.StringIO(), io.StringIO()
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = command(list(argv))
    except SystemExit as ex:
        code = ex.code  # type: ignore[assignment]
    finally:
        torch.set_num_threads(num_threads)
    returncode = 0 if code is None else code
    return subprocess.CompletedProcess(list(argv), returncode, stdout.getvalue(), stderr.getvalue())


def main_in_process(
    recipe: Callable[[Any, Path], Any], config_class: type[Any], argv: Sequence[str]
) -> subprocess.CompletedProcess[str]:
    """``python -m RECIPE ARGV`` as :func:`in_process` runs it: ``runtime.main(recipe,
    config_class, argv)`` in this process."""
    from runtime import main

    return in_process(lambda args: main(recipe, config_class, args), argv)


def kill_9_after_first_checkpoint(
    command: Sequence[str], out: Path, *, timeout: float = 300
) -> list[int]:
    """Start ``command`` (a run writing to ``out``), wait for its first committed checkpoint and
    SIGKILL its process group and every process below it: torchrun or the trainer, and their
    workers (torchrun starts each in a session of its own), at once. Returns the steps of the
    checkpoints it left."""
    process = subprocess.Popen(
        list(command),
        env=child_env(),
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    manager = CheckpointManager(out / "checkpoints", Gangs.single())
    deadline = time.monotonic() + timeout
    while not (out / "checkpoints").is_dir() or not manager.list_checkpoints():
        assert process.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    below = descendants(process.pid)
    os.killpg(process.pid, signal.SIGKILL)
    for pid in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait(timeout=60)
    while any(_running(pid) for pid in below):
        assert time.monotonic() < deadline + 60, f"processes {below} outlived SIGKILL"
        time.sleep(0.02)
    return [info.step_nr for info in manager.list_checkpoints()]


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, theirs, ...), read from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The command name may hold spaces; the fields after it are fixed.
            parents[int(entry.name)] = int(
                (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            )
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` is there and not a zombie."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def run_quick_benchmark(
    case: str, output_dir: Path, *, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """One quick run of the benchmark suite's ``case`` (``--quick --runs 1``) into
    ``output_dir``; asserts nothing."""
    return run_python(
        "-m",
        "benchmarks",
        "--quick",
        "--runs",
        "1",
        "--cases",
        case,
        "--output-dir",
        str(output_dir),
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def two_rank_checks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One two-rank launch of ``tests/workers/two_rank_checks.py`` for the tests of its checks
    (checkpoint integrity and faults, agreement, data readers): ``OUT/CHECK/rank_R.json``."""
    out = tmp_path_factory.mktemp("two_rank_checks")
    assert_ok(torchrun(2, "tests/workers/two_rank_checks.py", str(out)))
    return out


@pytest.fixture(scope="session")
def preempted_dp2(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One launch of ``tests/workers/resume_toy.py`` on two ranks of 4 examples: the run trained
    to its end in ``OUT/reference``, then the same run stopped by SIGTERM to torchrun after step
    2 in ``OUT``. test_resume resumes it; the fault suite compares its runs with the reference.
    Returns ``OUT`` and the launch's result."""
    from tests.faults.jobs import DP2, stop_by_sigterm_to_torchrun

    out = tmp_path_factory.mktemp("preempted_dp2")
    return out, stop_by_sigterm_to_torchrun(out, 2, *DP2)


def rank_reports(out: Path, num_ranks: int) -> list[Any]:
    """What each rank of a worker wrote to ``out/rank_R.json``, by rank."""
    return [json.loads((out / f"rank_{rank}.json").read_text()) for rank in range(num_ranks)]


def needs_cpp_compiler() -> None:
    """Skip the test where inductor cannot compile for the CPU: it builds C++ with the
    machine's compiler."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("inductor on CPU needs a C++ compiler (g++ or c++), and none is on PATH")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL metrics file, in order."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The TensorBoard scalars under ``run_dir``: ``{tag: [(step, value), ...]}``."""
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {
        tag: [(event.step, event.value) for event in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }


def make_toy_trainer(
    tmp_path: Path,
    *,
    model: nn.Module | None = None,
    unit: TrainUnit[ToyBatch] | None = None,
    unit_kwargs: dict[str, Any] | None = None,
    lr: float = 0.1,
    momentum: float = 0.0,
    batch_size: int = 4,
    num_accumulate: int = 1,
    dataset_size: int = 32,
    device: torch.device | None = None,
    **kwargs: Any,
) -> Trainer[ToyBatch]:
    """A one-process Trainer on the toy data, unshuffled, with SGD; ``kwargs`` go to the Trainer
    (the checkpoint manager is a CheckpointManager of ``tmp_path / "checkpoints"`` unless given).

    ``unit`` (on its own model) replaces the default summed-loss ToyUnit. With ``device`` the
    gangs and the default model are there (the reader's batches stay on the CPU).
    """
    gangs = Gangs.single(device=device)
    torch.manual_seed(0)
    model = unit.model if unit is not None else model or ToyModel().to(device)
    reader = MapDataReader(
        dataset=ToyDataset(dataset_size),
        batch_size=batch_size,
        collate=collate,
        gang=gangs.dp,
        num_accumulate=num_accumulate,
        shuffle=False,
    )
    if unit is None:
        options = {"mean_loss": False, "zero_targets": False} | (unit_kwargs or {})
        unit = ToyUnit(model, **options)
    kwargs.setdefault("max_num_steps", 1)
    kwargs.setdefault("checkpoint_manager", CheckpointManager(tmp_path / "checkpoints", gangs))
    return Trainer(
        unit=unit,
        data_reader=reader,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
        gangs=gangs,
        progress=False,
        **kwargs,
    )


WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "over", "green"]
WORDS += ["hills", "and", "birds", "sang"]


def sft_records(
    rng: random.Random, count: int, *, max_prompt_words: int
) -> list[dict[str, object]]:
    """``count`` records of ``task=sft`` made of :data:`WORDS`: a prompt of 3 to
    ``max_prompt_words`` words and a response of 1 to 4."""
    return [
        {
            "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, max_prompt_words))),
            "response": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))),
        }
        for _ in range(count)
    ]


"""The vocabulary of the tests' small texts and word-level tokenizers."""


def make_tokenizer_dir(
    directory: Path, texts: Sequence[str], *, config_file: str | None = "tokenizer_config.json"
) -> Path:
    """A Hugging Face tokenizer directory made here: a word-level ``tokenizer.json`` trained on
    ``texts``, with ``<s>`` (id 1) and ``</s>`` (id 2) named BOS and EOS by ``config_file``
    (``tokenizer_config.json``, ``special_tokens_map.json`` or ``config.json``; None: no file)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(list(texts), trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if config_file == "config.json":
        config: dict[str, Any] = {"bos_token_id": 1, "eos_token_id": [2, 0]}
    else:
        config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    if config_file is not None:
        (directory / config_file).write_text(json.dumps(config))
    return directory


@pytest.fixture(params=["fast", "public"])
def checkpoint_io(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test on each of the checkpoint package's two ways through DCP (the fast path for
    the tested torch versions, and public DCP); torchrun children inherit the choice."""
    from checkpoint.dcp_io import IO_ENV_VAR

    monkeypatch.setenv(IO_ENV_VAR, request.param)
    return str(request.param)


@pytest.fixture(params=["private", "public"])
def torch_private_apis(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test on each side of :mod:`gangs.torch_versions`: torch's private APIs (the
    tested torch versions' path) and their public fallbacks; torchrun children inherit it."""
    from gangs.torch_versions import PRIVATE_APIS_ENV_VAR

    monkeypatch.setenv(PRIVATE_APIS_ENV_VAR, request.param)
    return str(request.param)


def public_torch_path_in_test_all(test: Callable[..., None]) -> Callable[..., None]:
    """For a long multi-process test of :func:`torch_private_apis`: `make test` runs it on the
    private path (the one the tested torch versions take), `make test-all` on both."""
    on_both_paths = pytest.mark.usefixtures("torch_private_apis")(test)
    return pytest.mark.parametrize(
        "torch_private_apis",
        ["private", pytest.param("public", marks=pytest.mark.slow)],
        indirect=True,
    )(on_both_paths)


@pytest.fixture
def gangs_with_mesh_of_one(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gangs]:
    """The gangs of this process alone with a process group (gloo) and a DeviceMesh of size 1,
    as ``data_parallel=fsdp`` makes them on one process; destroyed after the test."""
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "1")
    gangs = setup_gangs(device=torch.device("cpu"), force_process_group=True)
    try:
        yield gangs
    finally:
        gangs.root.close()
    assert not dist.is_initialized()


@pytest.fixture(autouse=True)
def fail_on_logging_errors(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A test fails when a log record could not be written ("--- Logging error ---"): a handler
    whose stream was closed under it, or a message whose arguments do not format."""
    errors: list[str] = []
    original = logging.Handler.handleError

    def record(handler: logging.Handler, log_record: logging.LogRecord) -> None:
        errors.append(f"{type(handler).__name__}: {sys.exc_info()[1]!r} for {log_record.msg!r}")
        original(handler, log_record)

    monkeypatch.setattr(logging.Handler, "handleError", record)
    yield
    assert not errors, "logging errors:\n" + "\n".join(errors)


def round_trip(state: Mapping[str, object]) -> dict[str, Any]:
    """``state`` as a checkpoint gives it back: saved, then loaded with ``weights_only=True``."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


@final
class TwinRanksGang(Gang):
    """A gang of two ranks, the other one a twin that holds what this one holds, on ``device``
    (never touched: a CUDA one works without CUDA). It records the device of each tensor its
    collectives are given, so a test sees which device a collective would run on."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self.collective_devices: list[torch.device] = []

    rank = property(lambda self: 0)
    size = property(lambda self: 2)
    device = property(lambda self: self._device)

    def all_reduce(self, tensor: Tensor, op: ReduceOperation) -> None:
        self.collective_devices.append(tensor.device)
        if op is ReduceOperation.SUM:
            tensor.mul_(2)

    def all_gather(self, output_tensor: Tensor, input_tensor: Tensor) -> None:
        self.collective_devices.append(input_tensor.device)
        output_tensor.copy_(input_tensor.unsqueeze(0).expand_as(output_tensor))

    def close(self) -> None: ...
    def make_gang(self, ranks: Sequence[int]) -> Gang | None: ...
    def as_process_group(self) -> ProcessGroup: ...
    def barrier(self) -> None: ...
    def all_gather_to_list(self, output_tensors: list[Tensor], input_tensor: Tensor) -> None: ...
    def broadcast(self, tensor: Tensor, source_rank: int = 0) -> None: ...
    def broadcast_objects(self, objects: list[Any], source_rank: int = 0) -> None: ...
    def all_gather_objects(self, obj: Any) -> list[Any]: ...


def assert_published_norms_are_exact(run_dir: Path, max_norm: float | None = None) -> None:
    """Each step's published ``grad_norm`` of the run in ``run_dir`` is within 1e-6 relative of
    the float64 norm of the same gradients (``reference_norms.json``, written by
    ``tests.workers.train_toy.ReferenceNorms``, one record published a step).

    With clipping at ``max_norm`` the reference saw the clipped gradients: they are divided by
    the factor the step applied, computed as it computes it (in float32, from the published
    norm)."""
    references = json.loads((run_dir / "reference_norms.json").read_text())
    records = read_jsonl(run_dir / "metrics" / "train.jsonl")
    assert [r["step_nr"] for r in records] == [int(step) for step in references]
    for record in records:
        published, reference = record["grad_norm"], references[str(record["step_nr"])]
        if max_norm is not None:
            norm = torch.tensor(published, dtype=torch.float32)
            reference /= float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        assert published == pytest.approx(reference, rel=1e-6, abs=0), record["step_nr"]
