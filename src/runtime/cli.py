"""The recipe command line: ``python -m recipes.x OUTPUT_DIR [--config-file F]... [--config k=v]...``.

A recipe module ends with ``if __name__ == "__main__": main(recipe, ConfigClass)``; the same module
also runs under ``torchrun``, one process per rank. ``--evaluate {last,best,STEP}`` evaluates a
saved checkpoint of OUTPUT_DIR instead of training (see :func:`main`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, Protocol, TypeVar, final

import torch.distributed as dist

from checkpoint import (
    CheckpointChoice,
    CheckpointDirectoryError,
    CheckpointError,
    CheckpointLayoutError,
)
from checkpoint.durable import write_text_atomically
from gangs import GangError
from runtime.config import ConfigError, dump_config, load_config
from runtime.init_weights import InitialWeightsError

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
    builds its trainer, print one ``error: ...`` line to stderr and exit with status 2. Errors from
    ``run()`` itself propagate with their traceback.

    With ``--evaluate WHICH`` (``last``, ``best`` or a step number) the recipe's trainer is built
    the same way, but instead of ``run()`` its ``evaluate_checkpoint(WHICH)`` loads that
    checkpoint's model from OUTPUT_DIR and runs the valid units on it; the values are published
    as the ``eval`` run (``metrics/eval.jsonl``, ``eval/<name>.jsonl``, ``tb/eval``) with the
    metric names of ``valid``, at the checkpoint's step. A missing checkpoint exits with status 2,
    and ``config.yaml`` is left as the training wrote it.
    """
    args = _make_parser().parse_args(argv)
    try:
        config = load_config(config_class, config_files=args.config_files, overrides=args.config)
    except ConfigError as ex:
        _fail(str(ex))

    if args.dump_config:
        sys.stdout.write(dump_config(config))
        sys.exit(0)

    rank = _read_rank()
    output_dir: Path = args.output_dir
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as ex:
        _fail(f"The output directory '{output_dir}' cannot be created: {ex}")

    setup_logging(output_dir, rank)
    try:
        config_text = dump_config(config)
        log.info("Effective config:\n%s", config_text.rstrip(), extra=_FILE_ONLY)
        if rank == 0 and args.evaluate is None:
            write_text_atomically(output_dir / "config.yaml", config_text)
            log.info(
                "Wrote the effective config to %s", output_dir / "config.yaml", extra=_FILE_ONLY
            )

        try:
            runnable = recipe(config, output_dir)
        except (ValueError, GangError) as ex:
            # Bad values the config types cannot express (e.g. a negative step count, a tp_size
            # that does not divide the world) surface here; the traceback goes to the rank log in
            # case the error is a bug, not a bad value.
            log.exception("The recipe rejected the config: %s", ex, extra=_FILE_ONLY)
            _fail(str(ex))

        if args.evaluate is not None:
            _evaluate(runnable, args.evaluate)
            sys.exit(0)

        try:
            code = runnable.run()
        except (CheckpointLayoutError, CheckpointDirectoryError, InitialWeightsError) as ex:
            # Another world layout, ranks without a shared directory, or init_from weights that
            # do not fit the model: a launch mistake, not a crash.
            log.exception("The run cannot resume: %s", ex, extra=_FILE_ONLY)
            _fail(str(ex))
        except Exception:
            # The traceback reaches stderr too, but for ranks above 0 only via torchrun's output.
            log.exception("The run failed.", extra=_FILE_ONLY)
            raise
        log.info("The recipe finished with exit status %s.", code or 0)
        sys.exit(code or 0)
    finally:
        # A process that exits with its process group alive aborts instead of exiting cleanly.
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


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


def setup_logging(output_dir: Path, rank: int) -> None:
    """Log every rank to ``output_dir/logs/rank_N.log`` and rank 0 also to stderr, at INFO."""
    log_dir = output_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    file_handler = logging.FileHandler(log_dir / f"rank_{rank}.log", encoding="utf-8")
    file_handler.setFormatter(
        logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    )
    handlers: list[logging.Handler] = [file_handler]
    if rank == 0:
        console_handler = logging.StreamHandler(sys.stderr)
        console_handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        )
        console_handler.addFilter(_skip_file_only)
        handlers.append(console_handler)

    # force: a library may have configured the root logger on import; ours must win.
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True)


# The console stays quiet about what is already in config.yaml and the log files, so that a
# failing run shows just its one error line.
_FILE_ONLY = {"file_only": True}


def _skip_file_only(record: logging.LogRecord) -> bool:
    return not getattr(record, "file_only", False)


@final
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage block; one line is easier to spot in a torchrun log.
        hint = ""
        if "OUTPUT_DIR" in message:
            # `--config a=1 OUT` swallows OUT as a second override.
            hint = " Put OUTPUT_DIR first, since --config takes every value after it."
        _fail(f"{message}.{hint} Run with --help for usage.")


def _make_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        description="Run a recipe. Config values come from the recipe's defaults, then each "
        "--config-file in order, then each --config override in order (later wins).",
    )
    parser.add_argument(
        "output_dir",
        metavar="OUTPUT_DIR",
        type=Path,
        help="where config.yaml, logs/, metrics/ and checkpoints/ go",
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
        "--dump-config",
        action="store_true",
        help="print the effective config as YAML and exit without running",
    )
    return parser


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


def _fail(message: str) -> NoReturn:
    print(f"error: {' '.join(message.splitlines())}", file=sys.stderr)
    sys.exit(USAGE_ERROR_EXIT_CODE)
