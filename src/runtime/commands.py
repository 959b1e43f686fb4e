"""``python -m runtime``: inspect and export the checkpoints of a run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from checkpoint import CheckpointChoice, CheckpointError, CheckpointManager
from gangs import Gangs


def list_checkpoints(output_dir: Path) -> str:
    """A table of the run's checkpoints: step, score, size, kind and state (verified)."""
    manager = CheckpointManager(output_dir / "checkpoints", Gangs.single())
    rows = [("step", "score", "size", "kind", "state")]
    for info in manager.list_checkpoints():
        try:
            manager.verify(info.step_nr)
            state = "ok"
        except CheckpointError as ex:
            state = f"damaged: {ex}"
        score = "-" if info.score is None else f"{info.score:.6g}"
        rows.append((str(info.step_nr), score, _human_size(info.size_bytes), info.kind, state))
    for path in manager.incomplete_dirs():
        rows.append((path.name, "-", "-", "-", "incomplete (never committed; ignored)"))
    for path in manager.damaged_dirs():
        rows.append((path.name, "-", "-", "-", "damaged (moved aside by a resume; never loaded)"))
    if len(rows) == 1:
        return f"No checkpoints in {manager.checkpoint_dir}."
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
        + "  "
        + row[4]
        for row in rows
    )


def export_model(
    output_dir: Path, destination: Path, *, step_nr: int | None, best: bool, lower_better: bool
) -> int:
    """Write the model of a checkpoint as one ``state_dict`` file for plain ``torch.load``.

    Returns the step exported: ``step_nr``, the best scored one, or by default the last one.
    """
    manager = CheckpointManager(output_dir / "checkpoints", Gangs.single())
    which: CheckpointChoice = step_nr if step_nr is not None else "best" if best else "last"
    step_nr = manager.select_checkpoint(which, lower_better=lower_better)
    state = manager.read_model_state(step_nr)
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(destination.name + ".partial")
    torch.save(state, partial)
    # Checked before it replaces anything: the file must load with weights_only=True.
    torch.load(partial, weights_only=True)
    partial.replace(destination)
    return step_nr


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    listing = commands.add_parser("checkpoints", help="list the checkpoints of OUTPUT_DIR")
    listing.add_argument("output_dir", type=Path, metavar="OUTPUT_DIR")

    export = commands.add_parser("export", help="write a checkpoint's model as one state_dict file")
    export.add_argument("output_dir", type=Path, metavar="OUTPUT_DIR")
    export.add_argument("destination", type=Path, metavar="FILE")
    which = export.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="the step to export (default: the last)")
    which.add_argument("--best", action="store_true", help="the best scored checkpoint")
    export.add_argument(
        "--higher-better", action="store_true", help="with --best: a higher score is better"
    )

    args = parser.parse_args(argv)
    try:
        if args.command == "checkpoints":
            print(list_checkpoints(args.output_dir))
        else:
            step_nr = export_model(
                args.output_dir,
                args.destination,
                step_nr=args.step,
                best=args.best,
                lower_better=not args.higher_better,
            )
            print(f"Exported the model of step {step_nr} to {args.destination}.")
    except (CheckpointError, ValueError) as ex:
        print(f"error: {ex}", file=sys.stderr)
        return 2
    return 0


def _human_size(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
