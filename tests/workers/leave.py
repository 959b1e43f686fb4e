"""How the test workers end once their results are written."""

from __future__ import annotations

import gc
import sys
from typing import NoReturn

import torch.distributed as dist

from gangs import Gang
from runtime import Trainer


def leave(gang: Gang, *trainers: Trainer) -> NoReturn:
    """Close ``trainers``, wait for every rank, then exit 0 the way ``runtime.main`` does: the
    process groups destroyed while the interpreter is whole, so gloo's threads cannot abort the
    process at its teardown."""
    for trainer in trainers:
        trainer.close()
    gang.barrier()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(0)
