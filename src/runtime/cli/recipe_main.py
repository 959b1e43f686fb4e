"""The recipe command line: ``python -m recipes.x OUTPUT_DIR [--preset P]... [--config-file F]... [--config k=v]...``.

``--help`` lists the config's keys with their meanings, and ``--dump-config`` prints every key's
value with the required ones marked; neither needs OUTPUT_DIR or the required keys. A recipe module ends with ``if __name__ == "__main__": main(recipe, ConfigClass)``; the same module
also runs under ``torchrun``, one process per rank. ``--evaluate {last,best,STEP}`` evaluates a
saved checkpoint of OUTPUT_DIR instead of training (see :func:`main`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import logging.handlers
import os
import shutil
import sys
import textwrap
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, Protocol, TypeVar, final

import torch
import torch.distributed as dist

from checkpoint import (
    CheckpointChoice,
    CheckpointDirectoryError,
    CheckpointError,
    CheckpointLayoutError,
)
from checkpoint.errors import exception_chain
from gangs import (
    GangError,
    GangSizeError,
    LaunchBarrier,
    LaunchRefused,
    ProcessGroupGang,
    is_collective_timeout,
)
from gangs.setup import GANG_SIZE_ARGUMENTS
from runtime.cli.config import (
    ConfigError,
    config_changes,
    config_help,
    describe_config,
    dump_config,
    keys_named,
    load_config,
)
from runtime.cli.presets import recipe_presets
from runtime.cli.run_lock import LauncherWatchdog, RunLock, RunLockError
from runtime.parallel.process_group import process_group_exists
from runtime.training.initial_weights import InitialWeightsError
from runtime.training.loss_spike import LossSpikeError
from runtime.training.signals import PREEMPTED_EXIT_CODE, StartupInterrupted, StartupSignals
from trainkit_utils.files import write_text_atomically
from units.errors import UserFunctionError

ConfigT = TypeVar("ConfigT")

log = logging.getLogger(__name__)

USAGE_ERROR_EXIT_CODE = 2
"""The exit status for a bad command line or config, as argparse uses."""


class Runnable(Protocol):
    """What a recipe returns: something to run, such as a ``Trainer``."""

    def run(self) -> int | None: ...


def main(
    recipe: Callable[[ConfigT, Path], Runnable],
    config_class: type[ConfigT],
    argv: Sequence[str] | None = None,
) -> NoReturn:
    """Parse the command line, build the config, set up the output directory, run the recipe.

    A bad command line or config, and a ``ValueError`` or ``GangError`` raised while the recipe
    builds its trainer, print one ``error: ...`` line to stderr and exit with status 2, leaving no
    ``config.yaml`` and no checkpoints behind (only ``logs/`` with the error). Errors from
    ``run()`` itself propagate with their traceback, except a collective that failed or timed
    out (one ``error:`` line naming the collective and the step, exit status 1), a run stopped
    by loss spikes (one ``error:`` line listing them, exit status 1) and a checkpoint
    this config cannot resume from (exit status 2, see below).

    Under ``torchrun`` the ranks meet at a :class:`~gangs.LaunchBarrier` before the recipe runs:
    when one rank refuses or fails during start-up, every rank of the launch exits within
    seconds with the same ``error: rank N: ...`` line, and torchrun never has to kill a worker.

    Rank 0 holds ``OUTPUT_DIR/run.lock`` while training (see :mod:`runtime.cli.run_lock`): a second
    run on a directory in use exits with status 2 and a message naming the holder, before it
    writes anything. Under ``torchrun`` every worker exits soon after its launcher dies.

    When OUTPUT_DIR holds the ``config.yaml`` of an earlier run, the log lists what changed. A
    change the checkpoints cannot follow (a model shape, a world layout) fails the resume with
    status 2, a message saying how to start fresh or resume anyway, and the old ``config.yaml``
    kept.

    With ``--evaluate WHICH`` (``last``, ``best`` or a step number) the recipe's trainer is built
    the same way, but instead of ``run()`` its ``evaluate_checkpoint(WHICH)`` loads that
    checkpoint's model from OUTPUT_DIR and runs the valid units on it; the values are published
    as the ``eval`` run (``metrics/eval.jsonl``, ``eval/<name>.jsonl``, ``tb/eval``) with the
    metric names of ``valid``, at the checkpoint's step. A missing checkpoint exits with status 2,
    and ``config.yaml`` is left as the training wrote it.

    Every way out (a finished run, an evaluation, a refusal, an error) closes what the recipe
    built (``close()`` of its trainer) and then destroys the process groups, while the
    interpreter is still whole: gloo's threads must not outlive it.
    """
    launch = LaunchBarrier.from_environment()
    code = 1
    try:
        with contextlib.ExitStack() as stack:
            # Registered first, so it runs last: after the trainer let go of its groups.
            stack.callback(_destroy_process_groups)
            code = _main(recipe, config_class, argv, launch, stack)
    except _Refusal as ex:
        if launch is not None:
            launch.fail(ex.message, exit_code=ex.exit_code)
        print(f"error: {ex.message}", file=sys.stderr)
        code = ex.exit_code
    except LaunchRefused as ex:
        log.error("Another rank could not start: %s", ex.reason, extra=_FILE_ONLY)
        print(f"error: {ex.reason}", file=sys.stderr)
        code = ex.exit_code
    except BaseException as ex:
        if launch is not None and not isinstance(ex, SystemExit):
            launch.fail(f"{type(ex).__name__}: {_one_line(str(ex))}", exit_code=1)
        raise
    sys.exit(code)


def _main(
    recipe: Callable[[ConfigT, Path], Runnable],
    config_class: type[ConfigT],
    argv: Sequence[str] | None,
    launch: LaunchBarrier | None,
    stack: contextlib.ExitStack,
) -> int:
    """:func:`main` between the launch barrier and the exit; returns the exit status."""
    presets = recipe_presets(recipe)
    parser = _make_parser(config_class, presets)
    args = parser.parse_args(argv)
    config_files = [*(presets[name] for name in args.presets), *args.config_files]
    if args.dump_config:
        # Before load_config: the dump shows the keys a user has yet to give.
        try:
            text = describe_config(config_class, config_files=config_files, overrides=args.config)
        except ConfigError as ex:
            _fail(str(ex))
        sys.stdout.write(text)
        return 0
    if args.output_dir is None:
        parser.error("the following arguments are required: OUTPUT_DIR")
    try:
        config = load_config(config_class, config_files=config_files, overrides=args.config)
    except ConfigError as ex:
        _fail(str(ex))

    rank = _read_rank()
    output_dir: Path = args.output_dir
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as ex:
        _fail(f"The output directory '{output_dir}' cannot be created: {ex}")

    logs = _RankLogs(output_dir, rank)
    stack.callback(logs.close)
    startup_signals = stack.enter_context(StartupSignals())
    stack.enter_context(_exit_on_startup_signal())
    if rank == 0 and args.evaluate is None:
        stack.enter_context(_claim(output_dir))
    if launch is not None:
        launch.wait("recipe", _LAUNCH_TIMEOUT)
    # Other ranks reach the log files once the recipe built their gangs, so only after rank 0
    # holds the lock: a refused launch leaves the logs of the run it collided with alone.
    if rank == 0:
        logs.attach()
    if LauncherWatchdog.wanted():
        watchdog = LauncherWatchdog()
        watchdog.start()
        stack.callback(watchdog.stop)
    run = _Run(config, output_dir, rank, logs, launch)
    return run.execute(recipe, args.evaluate, startup_signals, args.resume_from)


_LAUNCH_TIMEOUT = timedelta(minutes=15)
"""How long the ranks of a launch wait for each other before the recipe, as the gangs do."""


@final
class _Run:
    """The steps of :func:`main` between the lock and the exit."""

    def __init__(
        self,
        config: object,
        output_dir: Path,
        rank: int,
        logs: _RankLogs,
        launch: LaunchBarrier | None,
    ) -> None:
        self._config = config
        self._output_dir = output_dir
        self._rank = rank
        self._logs = logs
        self._launch = launch
        self._config_text = dump_config(config)
        self._previous_text = _read_previous_config(output_dir / "config.yaml")
        self._changes = config_changes(self._previous_text, config)

    def execute(
        self,
        recipe: Callable[[Any, Path], Runnable],
        evaluate: CheckpointChoice | None,
        startup_signals: StartupSignals,
        resume_from: Path | None = None,
    ) -> int:
        """Build the recipe's runnable, train or evaluate with it, and close it on every path."""
        runnable = self.build(recipe)
        try:
            if resume_from is not None:
                _set_resume_from(runnable, resume_from)
            if evaluate is not None:
                _evaluate(runnable, evaluate)
                return 0
            startup_signals.disarm()
            try:
                code = self.train(runnable)
            except BaseException as ex:
                _let_the_launcher_see_the_vanished_peer(ex)
                raise
            log.info("The recipe finished with exit status %s.", code)
            return code
        finally:
            close = getattr(runnable, "close", None)
            if callable(close):
                close()

    def build(self, recipe: Callable[[Any, Path], Runnable]) -> Runnable:
        log.info("Effective config:\n%s", self._config_text.rstrip(), extra=_FILE_ONLY)
        try:
            runnable = recipe(self._config, self._output_dir)
        except Exception as ex:
            refusal = self._refusal(ex)
            # A peer that could not start ends this rank's collectives with a closed connection;
            # its own reason is the one to show. A peer that refused in the same words refused
            # the config, as this rank did: then every rank prints the same line, without a rank.
            peer_failure = None if self._launch is None else self._launch.failure()
            if peer_failure is not None and peer_failure.cause != refusal:
                raise peer_failure from ex
            if refusal is None:
                raise
            # The traceback goes to the rank log in case the error is a bug, not a bad value.
            self._logs.attach()
            log.exception("The recipe rejected the config: %s", refusal, extra=_FILE_ONLY)
            _fail(refusal)
        self._logs.attach()
        return runnable

    def _refusal(self, ex: Exception) -> str | None:
        """The ``error:`` line of a config the recipe rejected while building (a bad value the
        config types cannot express, e.g. a negative step count, a tp_size that does not divide
        the world), None for an error that is no refusal.

        A gang size is named as the config key the user set (``gang.ep_size``), not as the
        ``setup_gangs`` argument the recipe passed it to."""
        if isinstance(ex, GangSizeError):
            return ex.naming(keys_named(type(self._config), GANG_SIZE_ARGUMENTS))
        if isinstance(ex, ValueError | GangError):
            return str(ex)
        return None

    def train(self, runnable: Runnable) -> int:
        config_file = self._output_dir / "config.yaml"
        if self._changes:
            log.info(
                "The config differs from %s, written by the run here before: %s.",
                config_file,
                "; ".join(self._changes),
            )
        if self._rank == 0:
            write_text_atomically(config_file, self._config_text)
            log.info("Wrote the effective config to %s", config_file, extra=_FILE_ONLY)
        try:
            return runnable.run() or 0
        except (CheckpointDirectoryError, InitialWeightsError) as ex:
            # Ranks without a shared directory, or init_from weights that do not fit the model:
            # a launch mistake, not a crash.
            log.exception("The run cannot start: %s", ex, extra=_FILE_ONLY)
            _fail(str(ex))
        except CheckpointError as ex:
            if isinstance(ex, CheckpointLayoutError) or self._changes:
                self._refuse_resume(ex)
            log.exception("The run failed.", extra=_FILE_ONLY)
            raise
        except GangError as ex:
            self._collective_failed(runnable, str(ex))
        except UserFunctionError as ex:
            # The user's function (a reward function) failed: the message names it.
            log.exception("The run stopped: %s", ex, extra=_FILE_ONLY)
            raise _Refusal(str(ex), exit_code=1) from None
        except LossSpikeError as ex:
            # Every rank stopped on the same spikes; the message lists them.
            log.exception("The run stopped: %s", ex, extra=_FILE_ONLY)
            raise _Refusal(str(ex), exit_code=1) from None
        except RuntimeError as ex:
            # A collective inside torch (DDP's gradient all-reduce, FSDP, DCP) that timed out.
            if not (is_collective_timeout(ex) and dist.is_initialized()):
                log.exception("The run failed.", extra=_FILE_ONLY)
                raise
            world = ProcessGroupGang(_world_group(), device=torch.device("cpu"))
            self._collective_failed(runnable, str(world.timeout_error(_origin(ex), ex)))
        except Exception:
            # The traceback reaches stderr too, but for ranks above 0 only via torchrun's output.
            log.exception("The run failed.", extra=_FILE_ONLY)
            raise

    def _collective_failed(self, runnable: Runnable, message: str) -> NoReturn:
        """One ``error:`` line with the step and exit 1: the stack of a hung peer helps nobody."""
        step_nr = getattr(runnable, "step_nr", None)
        at_step = f" at step {step_nr}" if isinstance(step_nr, int) else ""
        log.exception("The run failed%s: %s", at_step, message, extra=_FILE_ONLY)
        raise _Refusal(f"The run failed{at_step}: {message}", exit_code=1)

    def _refuse_resume(self, ex: CheckpointError) -> NoReturn:
        """Keep the old config.yaml and say how to start fresh or resume anyway."""
        if self._rank == 0 and self._previous_text is not None:
            write_text_atomically(self._output_dir / "config.yaml", self._previous_text)
        message = str(ex)
        if self._changes:
            message += (
                f" The config differs from the run in {self._output_dir}: "
                f"{'; '.join(self._changes)}. To start fresh, pass another OUTPUT_DIR (or move "
                f"{self._output_dir / 'checkpoints'} away); to resume, run with the old values "
                f"again (in {self._output_dir / 'config.yaml'})."
            )
        # Relaunching a run with another world layout or model is a launch mistake, not a crash.
        log.exception("The run cannot resume: %s", message, extra=_FILE_ONLY)
        _fail(message)


def _set_resume_from(runnable: Runnable, path: Path) -> None:
    """Hand ``--resume-from`` to the trainer the recipe built; a bad path exits with status 2."""
    if not hasattr(runnable, "resume_from"):
        _fail(
            f"--resume-from is given, but the recipe returned a {type(runnable).__name__}, which "
            "has no resume_from. Return a Trainer, or drop --resume-from."
        )
    try:
        runnable.resume_from = path  # type: ignore[attr-defined]
    except ValueError as ex:
        _fail(str(ex))


@contextlib.contextmanager
def _exit_on_startup_signal() -> Iterator[None]:
    try:
        yield
    except StartupInterrupted as ex:
        log.warning("%s Exiting without training; launch again to start.", ex)
        sys.exit(PREEMPTED_EXIT_CODE)


@contextlib.contextmanager
def _claim(output_dir: Path) -> Iterator[RunLock]:
    lock = RunLock(output_dir)
    try:
        lock.acquire()
    except RunLockError as ex:
        _fail(str(ex))
    except OSError as ex:
        _fail(f"The output directory '{output_dir}' is not writable: {ex}")
    try:
        yield lock
    finally:
        lock.release()


_PEER_FAILURE_GRACE = 3.0
"""Seconds a rank whose peer vanished waits before it fails too (see below)."""


def _let_the_launcher_see_the_vanished_peer(ex: BaseException) -> None:
    """Under torchrun, wait a little before failing because a peer rank died.

    A killed rank's sockets close before the kernel reports it dead, so this rank's own failure
    can reach torchrun first; torchrun then reports it as the root cause and never mentions the
    rank that was killed. Waiting lets the real root cause come first (torchrun stops this rank
    with SIGTERM meanwhile).
    """
    if not LauncherWatchdog.wanted():
        return
    for cause in exception_chain(ex):
        text = str(cause).lower()
        if "closed by peer" in text or "reset by peer" in text:
            log.warning("A peer rank vanished; waiting for the launcher to notice it first.")
            time.sleep(_PEER_FAILURE_GRACE)
            return


def _world_group() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None
    return group


def _origin(ex: BaseException) -> str:
    """Where ``ex`` was raised, for a collective that is not a gang's: the innermost frames."""
    frames = traceback.extract_tb(ex.__traceback__)
    ours = [f for f in frames if "/torch/" not in f.filename]
    theirs = [f for f in frames if "/torch/" in f.filename]
    where = "A collective"
    if theirs:
        module = theirs[-1].filename.rsplit("/torch/", 1)[1].removesuffix(".py").replace("/", ".")
        where += f" in torch.{module}.{theirs[-1].name}"
    if ours:
        where += f" (called from {Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].name})"
    return where


def _destroy_process_groups() -> None:
    """Destroy every process group while the interpreter is whole.

    Left to the interpreter's teardown, gloo's worker threads would free tensors after Python is
    gone and abort the process ("terminate called without an active exception"). Modules that
    still hold a group (DDP, FSDP2) are collected first, so none outlives its group.
    """
    if process_group_exists():
        gc.collect()
        dist.destroy_process_group()


def _read_previous_config(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as ex:
        log.warning("Cannot read the config of the earlier run, %s: %s", path, ex)
        return None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _evaluate(runnable: Runnable, which: CheckpointChoice) -> None:
    evaluate = getattr(runnable, "evaluate_checkpoint", None)
    if evaluate is None:
        _fail(
            "--evaluate needs a recipe that returns a Trainer (something with "
            f"evaluate_checkpoint()), but the recipe returned {type(runnable).__name__}."
        )
    try:
        evaluate(which)
    except (CheckpointError, ValueError) as ex:
        log.exception("The evaluation failed: %s", ex, extra=_FILE_ONLY)
        _fail(str(ex))
    log.info("The evaluation of checkpoint '%s' finished.", which)


@final
class _RankLogs:
    """The root logger of one rank: stderr (rank 0) at once; the rank's log file from attach().

    Records logged before :meth:`attach` wait in memory and reach the file when it is attached,
    so a launch that stops before then writes nothing to OUTPUT_DIR. :meth:`close` closes the
    handlers and gives the root logger back the handlers and level it had: a handler left on the
    root logger past :func:`main` would write to a stream its caller may since have closed (a
    test's captured stderr).
    """

    def __init__(self, output_dir: Path, rank: int) -> None:
        self._output_dir = output_dir
        self._rank = rank
        self._buffer = logging.handlers.MemoryHandler(
            capacity=100_000, flushLevel=logging.CRITICAL + 1
        )
        self._buffer.setFormatter(_file_formatter(rank))
        handlers: list[logging.Handler] = [self._buffer]
        if rank == 0:
            console_handler = logging.StreamHandler(sys.stderr)
            console_handler.setFormatter(
                logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
            )
            console_handler.addFilter(_skip_file_only)
            handlers.append(console_handler)
        root = logging.getLogger()
        # A library may have configured the root logger on import; ours win until close().
        self._previous = (root.handlers[:], root.level)
        for handler in self._previous[0]:
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(logging.INFO)
        self._handlers = handlers

    def close(self) -> None:
        root = logging.getLogger()
        for handler in self._handlers:
            root.removeHandler(handler)
            handler.close()
        previous_handlers, previous_level = self._previous
        for handler in previous_handlers:
            root.addHandler(handler)
        root.setLevel(previous_level)

    def attach(self) -> None:
        """Start writing ``logs/rank_N.log``, beginning with the records held so far."""
        if self._buffer.target is not None:
            return
        log_dir = self._output_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_dir / f"rank_{self._rank}.log", encoding="utf-8")
        file_handler.setFormatter(_file_formatter(self._rank))
        self._buffer.setTarget(file_handler)
        self._buffer.flush()
        root = logging.getLogger()
        root.removeHandler(self._buffer)
        root.addHandler(file_handler)
        self._handlers.append(file_handler)


def _file_formatter(rank: int) -> logging.Formatter:
    return logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")


# The console stays quiet about what is already in config.yaml and the log files, so that a
# failing run shows just its one error line.
_FILE_ONLY = {"file_only": True}


def _skip_file_only(record: logging.LogRecord) -> bool:
    return not getattr(record, "file_only", False)


@final
class _Parser(argparse.ArgumentParser):
    def __init__(self, config_class: type[object], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._config_class = config_class

    def format_help(self) -> str:
        # The keys' meanings are read from the config classes' source: only when help is asked.
        self.epilog = config_help(self._config_class, width=_help_width())
        return super().format_help()

    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage block; one line is easier to spot in a torchrun log.
        hint = ""
        if "OUTPUT_DIR" in message:
            # `--config a=1 OUT` swallows OUT as a second override.
            hint = " Put OUTPUT_DIR first, since --config takes every value after it."
        _fail(f"{message}.{hint} Run with --help for usage.")


def _help_width() -> int:
    """The width argparse wraps its help to."""
    return shutil.get_terminal_size().columns - 2


def _make_parser(
    config_class: type[object], presets: Mapping[str, Path]
) -> argparse.ArgumentParser:
    description = (
        "Run a recipe. Config values come from the recipe's defaults, then each --preset, then "
        "each --config-file in order, then each --config override in order (later wins)."
    )
    # Raw: the epilog, the config keys, is laid out by config_help, so the description is too.
    parser = _Parser(
        config_class,
        description=textwrap.fill(description, _help_width()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "output_dir",
        metavar="OUTPUT_DIR",
        type=Path,
        nargs="?",
        help="where config.yaml, logs/, metrics/ and checkpoints/ go (not needed with "
        "--dump-config)",
    )
    parser.add_argument(
        "--preset",
        dest="presets",
        metavar="NAME",
        choices=sorted(presets),
        action="append",
        default=[],
        help="a named config the recipe ships (its configs/NAME.yaml); repeat to merge several. "
        + (f"This recipe's: {', '.join(sorted(presets))}." if presets else "This recipe has none."),
    )
    parser.add_argument(
        "--config-file",
        dest="config_files",
        metavar="FILE",
        type=Path,
        action="append",
        default=[],
        help="a YAML file of config values; repeat to merge several",
    )
    parser.add_argument(
        "--config",
        metavar="KEY=VALUE",
        action="extend",
        nargs="+",
        default=[],
        help="a config override such as gang.tp_size=2, the value parsed as YAML; "
        "repeat the flag or give several after it",
    )
    _add_starting_points(parser)
    parser.add_argument(
        "--dump-config",
        action="store_true",
        help="print every config key with its value (defaults, then files and overrides) as "
        "YAML, the required ones marked, and exit without running",
    )
    return parser


def _add_starting_points(parser: argparse.ArgumentParser) -> None:
    """What the run starts from besides its OUTPUT_DIR: ``--evaluate`` a checkpoint instead of
    training, or ``--resume-from`` another run's."""
    parser.add_argument(
        "--evaluate",
        metavar="{last,best,STEP}",
        type=_parse_evaluate,
        default=None,
        help="instead of training, evaluate the last, the best (by validation score) or the "
        "given step's checkpoint of OUTPUT_DIR with the recipe's valid units; the values go to "
        "metrics/eval.jsonl",
    )
    parser.add_argument(
        "--resume-from",
        metavar="PATH",
        type=Path,
        default=None,
        help="start this run (in a new OUTPUT_DIR) from the full state of PATH, a step_N "
        "checkpoint directory of any run: model, optimizer, schedulers, data position, RNG, "
        "step, scores",
    )


def _parse_evaluate(text: str) -> CheckpointChoice:
    if text in ("last", "best"):
        return "last" if text == "last" else "best"
    try:
        step_nr = int(text)
    except ValueError:
        step_nr = -1
    if step_nr < 0:
        raise argparse.ArgumentTypeError(
            f"expected 'last', 'best' or a step number, but got '{text}'"
        )
    return step_nr


def _read_rank() -> int:
    text = os.environ.get("RANK", "0")
    try:
        return int(text)
    except ValueError:
        _fail(f"The RANK environment variable must be an integer, but is '{text}'.")


class _Refusal(Exception):
    """Ends :func:`main` with one ``error:`` line and an exit status, on every rank."""

    def __init__(self, message: str, *, exit_code: int = USAGE_ERROR_EXIT_CODE) -> None:
        super().__init__(message)
        self.message = _one_line(message)
        self.exit_code = exit_code


def _fail(message: str) -> NoReturn:
    raise _Refusal(message)
