"""``apply_data_parallel``'s DDP options under ``torchrun``, and the per-rank seeding.

Usage: ``ddp_options.py OUTPUT_DIR JSON_CASES``, JSON_CASES mapping each case's name to its
options; the cases run in order in one launch (one torchrun start-up), and each rank writes
``OUTPUT_DIR/NAME/rank_R.json``. A case trains two steps of a model with a layer its forward never
uses (which DDP refuses unless ``find_unused_parameters``) and writes DDP's options as it holds
them and the first numbers Python's and NumPy's generators draw after seeding, or the error DDP
raised. With ``sparse_by_hand`` it writes the Trainer's refusal of a sparse embedding that a
hand-made DDP reduces.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gangs import Gangs, setup_gangs
from runtime import apply_data_parallel
from runtime.parallel.sparse_embeddings import check_sparse_outside_ddp
from runtime.training.rng import seed_rngs
from tests.workers.leave import leave


class HalfUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 1)
        self.unused = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.used(x)


def run_case(gangs: Gangs, options: dict[str, Any]) -> object:
    torch.manual_seed(0)
    if options.pop("sparse_by_hand", False):
        # A sparse embedding in a DDP wrapped by hand: DDP reduces it, which the Trainer refuses.
        table = nn.parallel.DistributedDataParallel(nn.Embedding(4, 2, sparse=True))
        try:
            check_sparse_outside_ddp(table)
        except ValueError as error:
            return str(error)
        return None
    model = apply_data_parallel(HalfUsed(), gangs, **options)
    try:
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
    except RuntimeError as error:
        return {"error": str(error)}
    seed_rngs(7, dp_rank=gangs.dp.rank, dp_size=gangs.dp.size)
    return {
        "find_unused_parameters": model.find_unused_parameters,
        "static_graph": model.static_graph,
        "gradient_as_bucket_view": model.gradient_as_bucket_view,
        "python": random.random(),
        "numpy": float(np.random.rand()),
    }


def run_all(gangs: Gangs, output_dir: Path, cases: dict[str, dict[str, Any]]) -> None:
    """Each of ``cases`` in turn, into ``output_dir/NAME/rank_R.json``."""
    for name, options in cases.items():
        try:
            report = run_case(gangs, dict(options))
        except BaseException as ex:
            ex.add_note(f"(in ddp_options.py's case {name})")
            raise
        (output_dir / name).mkdir(parents=True, exist_ok=True)
        (output_dir / name / f"rank_{gangs.root.rank}.json").write_text(json.dumps(report))


def main(output_dir: Path, cases: dict[str, dict[str, Any]]) -> None:
    gangs = setup_gangs()
    run_all(gangs, output_dir, cases)
    leave(gangs.root)


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
