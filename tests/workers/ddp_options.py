"""``apply_data_parallel``'s DDP options under ``torchrun``, and the per-rank seeding.

Usage: ``ddp_options.py OUTPUT_DIR JSON_OPTIONS``. Trains two steps of a model with a layer its
forward never uses (which DDP refuses in the second backward unless ``find_unused_parameters``),
then each rank writes ``OUTPUT_DIR/rank_R.json``: DDP's options as it holds them, the first
numbers Python's and NumPy's generators draw after seeding.
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

from gangs import setup_gangs
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


def main(output_dir: Path, options: dict[str, Any]) -> None:
    gangs = setup_gangs()
    torch.manual_seed(0)
    if options.pop("sparse_by_hand", False):
        # A sparse embedding in a DDP wrapped by hand: DDP reduces it, which the Trainer refuses.
        table = nn.parallel.DistributedDataParallel(nn.Embedding(4, 2, sparse=True))
        try:
            check_sparse_outside_ddp(table)
        except ValueError as error:
            (output_dir / f"rank_{gangs.root.rank}.json").write_text(json.dumps(str(error)))
        leave(gangs.root)
    model = apply_data_parallel(HalfUsed(), gangs, **options)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
    seed_rngs(7, dp_rank=gangs.dp.rank, dp_size=gangs.dp.size)
    report = {
        "find_unused_parameters": model.find_unused_parameters,
        "static_graph": model.static_graph,
        "gradient_as_bucket_view": model.gradient_as_bucket_view,
        "python": random.random(),
        "numpy": float(np.random.rand()),
    }
    (output_dir / f"rank_{gangs.root.rank}.json").write_text(json.dumps(report))
    leave(gangs.root)


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
