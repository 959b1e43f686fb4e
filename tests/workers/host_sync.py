"""Watch the steady steps of a toy run for host syncs, for each feature of the host-sync tests,
under one parallel layout; each rank writes JSON.

Usage: ``host_sync.py OUTPUT_DIR KIND TP_SIZE``. One launch trains one small Trainer per feature
of :data:`tests.sync_detector.FEATURES`, one after another over the same gangs (the process
start-up is paid once), with ``KIND`` data parallelism (``ddp`` or ``fsdp``) over the DP gang and
the toy model's layers sharded over a TP gang of ``TP_SIZE``. Each rank writes
``OUTPUT_DIR/rank_R.json``: ``{feature: [sync, ...]}``, each sync the operation and its line.

``host_sync.py OUTPUT_DIR --layouts JSON`` watches several layouts of one world size in one
launch, JSON mapping each layout's name to ``[KIND, TP_SIZE, TORCH_PATH]`` (TORCH_PATH
``private`` or ``public``: its side of gangs.torch_versions); each rank writes
``OUTPUT_DIR/NAME/rank_R.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from checkpoint import CheckpointManager
from gangs import Gang, Gangs, setup_parallel_gangs, setup_root_gang
from gangs.torch_versions import PRIVATE_APIS_ENV_VAR
from runtime import (
    MapDataReader,
    TorchProfiler,
    Trainer,
    apply_data_parallel,
    apply_tensor_parallel,
)
from tests.sync_detector import FEATURES, SyncWindow
from tests.workers.leave import leave
from tests.workers.train_toy import ToyDataset, ToyModel, ToyUnit, collate


def watch(gangs: Gangs, kind: str, output_dir: Path, options: dict[str, Any]) -> list[str]:
    options = dict(options)
    if options.pop("profiler", False):
        options["profiler"] = TorchProfiler(1, 2, output_dir / "profile", gangs.root)
    torch.manual_seed(0)
    model = apply_tensor_parallel(
        ToyModel(), gangs, {"up": ColwiseParallel(), "down": RowwiseParallel()}
    )
    model = apply_data_parallel(model, gangs, kind="fsdp" if kind == "fsdp" else "ddp")
    reader = MapDataReader(
        dataset=ToyDataset(256),
        batch_size=4,
        collate=collate,
        gang=gangs.dp,
        num_accumulate=options.pop("num_accumulate", 1),
        shuffle=False,
    )
    window = SyncWindow()
    trainer = Trainer(
        unit=ToyUnit(model, mean_loss=False, zero_targets=False),
        data_reader=reader,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        checkpoint_manager=CheckpointManager(output_dir / "checkpoints", gangs),
        gangs=gangs,
        max_num_steps=10,
        publish_metrics_every_n_steps=100,
        callbacks=[window],
        progress=False,
        **options,
    )
    trainer.run()
    trainer.close()
    return window.detector.syncs


def watch_layout(gangs: Gangs, kind: str, output_dir: Path) -> None:
    found = {
        feature: watch(gangs, kind, output_dir / feature, options)
        for feature, options in FEATURES.items()
    }
    (output_dir / f"rank_{gangs.root.rank}.json").write_text(json.dumps(found, indent=1))


def run_all(root: Gang, output_dir: Path, layouts: dict[str, tuple[str, int, str | None]]) -> None:
    """Watch each of ``layouts`` in turn, into ``output_dir/NAME``; the torch path is left as
    found."""
    previous = os.environ.get(PRIVATE_APIS_ENV_VAR)
    for name, (kind, tp_size, torch_path) in layouts.items():
        if torch_path is not None:
            os.environ[PRIVATE_APIS_ENV_VAR] = torch_path
        (output_dir / name).mkdir(parents=True, exist_ok=True)
        try:
            watch_layout(setup_parallel_gangs(root, tp_size=tp_size), kind, output_dir / name)
        except BaseException as ex:
            ex.add_note(f"(in host_sync.py's layout {name})")
            raise
    if previous is None:
        os.environ.pop(PRIVATE_APIS_ENV_VAR, None)
    else:
        os.environ[PRIVATE_APIS_ENV_VAR] = previous


def main(output_dir: Path, layouts: dict[str, tuple[str, int, str | None]]) -> None:
    root = setup_root_gang()
    run_all(root, output_dir, layouts)
    leave(root)


if __name__ == "__main__":
    if sys.argv[2] == "--layouts":
        main(Path(sys.argv[1]), json.loads(sys.argv[3]))
    else:
        main(Path(sys.argv[1]), {".": (sys.argv[2], int(sys.argv[3]), None)})
