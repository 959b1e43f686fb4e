"""``python -m runtime``: inspect and export the checkpoints of a run; prepare text data."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from checkpoint import CheckpointChoice, CheckpointError, CheckpointManager
from checkpoint.health import unhealthy_reason
from gangs import Gangs
from models.hf.export import write_hf_directory
from models.lora.export import base_model_path, is_lora_run, merged_state, write_peft_directory
from runtime.cli.prepare_command import add_prepare_command, run_prepare, run_verify


def list_checkpoints(output_dir: Path) -> str:
    """A table of the run's checkpoints: step, score, size, kind, health (``unhealthy`` once
    marked so after a loss spike), retention (``permanent`` for a snapshot retention never
    deletes) and state (verified; why it is unhealthy)."""
    manager = CheckpointManager(output_dir / "checkpoints", Gangs.single())
    rows = [("step", "score", "size", "kind", "health", "retention", "state")]
    for info in manager.list_checkpoints():
        try:
            manager.verify(info.step_nr)
            state = "ok"
        except CheckpointError as ex:
            state = f"damaged: {ex}"
        reason = unhealthy_reason(manager.checkpoint_path(info.step_nr))
        if reason is not None:
            state += f"; unhealthy: {reason}"
        rows.append(
            (
                str(info.step_nr),
                "-" if info.score is None else f"{info.score:.6g}",
                _human_size(info.size_bytes),
                info.kind,
                "healthy" if info.healthy else "unhealthy",
                "permanent" if info.permanent else "-",
                state,
            )
        )
    aside = (
        (manager.incomplete_dirs(), "-", "incomplete (never committed; ignored)"),
        (manager.damaged_dirs(), "-", "damaged (moved aside by a resume; never loaded)"),
        (
            manager.replaced_dirs(),
            "unhealthy",
            "moved aside when a rolled-back run saved its step again; never loaded",
        ),
    )
    for paths, health, state in aside:
        rows.extend((path.name, "-", "-", "-", health, "-", state) for path in paths)
    if len(rows) == 1:
        return f"No checkpoints in {manager.checkpoint_dir}."
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
        + "  "
        + row[-1]
        for row in rows
    )


def export_model(
    output_dir: Path,
    destination: Path,
    *,
    step_nr: int | None,
    best: bool,
    lower_better: bool,
    format: Literal["pt", "hf", "peft"] = "pt",
) -> tuple[int, list[Path]]:
    """Write the model of a checkpoint as one ``state_dict`` file for plain ``torch.load``.

    When the ``safetensors`` package is importable, a ``.safetensors`` file (the format other
    tools read) is written beside it; a ``destination`` ending in ``.safetensors`` gets only
    that. With ``format="hf"``, ``destination`` is a Hugging Face model directory instead (see
    :mod:`models.hf.export`; a LoRA run's adapters merged into its base), and with
    ``format="peft"`` the adapters of a LoRA run (see :mod:`models.lora.export`). Returns
    the step exported (``step_nr``, the best scored one, or by default the last) and the files
    written.
    """
    manager = CheckpointManager(output_dir / "checkpoints", Gangs.single())
    which: CheckpointChoice = step_nr if step_nr is not None else "best" if best else "last"
    step_nr = manager.select_checkpoint(which, lower_better=lower_better)
    state = manager.read_model_state(step_nr)
    if format == "peft":
        return step_nr, write_peft_directory(state, output_dir, destination)
    if format == "hf":
        if is_lora_run(output_dir):
            from runtime.training.initial_weights import read_weights

            base = read_weights(base_model_path(output_dir))
            state = merged_state(state, output_dir, base)
        return step_nr, write_hf_directory(state, output_dir, destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    save_file = _safetensors_writer(required=destination.suffix == ".safetensors")
    torch_file = destination.with_name(destination.name + ".partial")
    torch.save(state, torch_file)
    # Checked before it replaces anything: the file must load with weights_only=True.
    state = torch.load(torch_file, weights_only=True)
    written = []
    if destination.suffix != ".safetensors":
        torch_file.replace(destination)
        written.append(destination)
    else:
        torch_file.unlink()
    if save_file is not None:
        safetensors_path = destination.with_suffix(".safetensors")
        partial = safetensors_path.with_name(safetensors_path.name + ".partial")
        save_file({key: value.contiguous() for key, value in state.items()}, str(partial))
        partial.replace(safetensors_path)
        written.append(safetensors_path)
    return step_nr, written


def _safetensors_writer(*, required: bool) -> Callable[[dict[str, Tensor], str], None] | None:
    try:
        from safetensors.torch import save_file  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        if required:
            raise ValueError(
                "The destination ends in .safetensors, but the safetensors package is not "
                "installed. Install it (pip install safetensors) or export to a .pt file."
            ) from None
        return None
    writer: Callable[[dict[str, Tensor], str], None] = save_file
    return writer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    listing = commands.add_parser("checkpoints", help="list the checkpoints of OUTPUT_DIR")
    listing.add_argument("output_dir", type=Path, metavar="OUTPUT_DIR")

    export = commands.add_parser(
        "export",
        help="write a checkpoint's model as one state_dict file, a Hugging Face dir or an adapter",
    )
    export.add_argument("output_dir", type=Path, metavar="OUTPUT_DIR")
    export.add_argument("destination", type=Path, metavar="DEST")
    export.add_argument(
        "--format",
        choices=("pt", "hf", "peft"),
        default="pt",
        help="pt: a state_dict file (and .safetensors); hf: a Hugging Face model directory "
        "(a LoRA run's adapters merged in); peft: a LoRA run's adapters for PeftModel",
    )
    which = export.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="the step to export (default: the last)")
    which.add_argument("--best", action="store_true", help="the best scored checkpoint")
    export.add_argument(
        "--higher-better", action="store_true", help="with --best: a higher score is better"
    )

    add_prepare_command(commands)

    args = parser.parse_args(argv)
    try:
        if args.command == "checkpoints":
            print(list_checkpoints(args.output_dir))
        elif args.command == "prepare":
            run_prepare(args)
        elif args.command == "verify-data":
            run_verify(args)
        else:
            step_nr, written = export_model(
                args.output_dir,
                args.destination,
                step_nr=args.step,
                best=args.best,
                lower_better=not args.higher_better,
                format=args.format,
            )
            files = " and ".join(str(path) for path in written)
            print(f"Exported the model of step {step_nr} to {files}.")
    except (CheckpointError, ValueError) as ex:
        print(f"error: {ex}", file=sys.stderr)
        return 2
    except OSError as ex:
        # A full disk, say: nothing finished is lost, and the same command goes on from it.
        print(
            f"error: {ex}. Free the space or fix the path, then run the same command again.",
            file=sys.stderr,
        )
        return 1
    return 0


def _human_size(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
