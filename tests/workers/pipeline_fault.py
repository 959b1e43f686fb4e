"""A pipeline stage's rank that dies mid-step, for tests/faults/test_pipeline_fault.py.

Usage: two processes of ``python tests/workers/pipeline_fault.py OUT TIMEOUT_SECONDS`` with
``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR``/``MASTER_PORT`` set, no ``torchrun``: nothing
tears the survivor down but its own collectives. They train the tiny Llama of
``pipeline_checks.py`` under PP=2 with 1F1B (4 microbatches, 2 accumulated batches a step),
the gangs' collective timeout ``TIMEOUT_SECONDS``. The last stage's rank writes
``OUT/dying`` and SIGKILLs itself in the forward of its 3rd microbatch of step 2; the first
stage's rank writes ``OUT/finished`` if its training ever ends (it must not).
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch import nn

from gangs import setup_parallel_gangs, setup_root_gang
from tests.workers import pipeline_checks

FORWARDS_BEFORE_DEATH = 8 + 2
"""Step 1 runs 2 batches of 4 microbatches through each stage; then 2 more of step 2."""


def main(output_dir: Path, timeout: float) -> None:
    root = setup_root_gang(timeout=timedelta(seconds=timeout))
    gangs = setup_parallel_gangs(root, pp_size=2)
    if gangs.pp.rank == 1:
        count = 0
        split_model = pipeline_checks.split_model

        def dying_split(*args: Any, **kwargs: Any) -> Any:
            stages, part = split_model(*args, **kwargs)

            def die(module: nn.Module, inputs: Any) -> None:
                nonlocal count
                count += 1
                if count > FORWARDS_BEFORE_DEATH:
                    (output_dir / "dying").write_text(str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGKILL)

            for stage in stages:
                stage.register_forward_pre_hook(die)
            return stages, part

        pipeline_checks.split_model = dying_split  # type: ignore[assignment]
    pipeline_checks.train(gangs, output_dir, {"schedule": "1f1b", "num_microbatches": 4})
    (output_dir / "finished").write_text(str(gangs.pp.rank))


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]))
