"""Count the collectives a training run makes on the root gang; each rank writes JSON.

Usage: ``collective_count.py OUTPUT_DIR KIND[,KIND...]``: each KIND in turn, in one launch (one
torchrun start-up), each rank writing ``OUTPUT_DIR/KIND/rank_R.json``. Six steps of two accumulated micro-batches under
``KIND`` data parallelism, publishing every third step, no validation and no checkpoint but the
final one, which is skipped by counting only until the last step ends. ``KIND`` is ``ddp``,
``fsdp``, or ``ddp-hooked``: DDP with a communication hook of the user's, which counts DDP's
own bucket all-reduces too (as ``ddp_bucket``).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, final

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from checkpoint import CheckpointManager
from gangs import Gang, Gangs, PendingCollective, ReduceOperation, setup_gangs
from runtime import MapDataReader, Trainer, TrainerCallback, apply_data_parallel
from tests.workers.leave import leave
from tests.workers.train_toy import ToyDataset, ToyModel, ToyUnit, collate


@final
class CountingGang(Gang):
    """Delegates to ``gang`` and counts its collectives by name while ``counting``."""

    def __init__(self, gang: Gang) -> None:
        self._gang = gang
        self.counting = False
        self.counts: Counter[str] = Counter()

    def _count(self, name: str) -> None:
        if self.counting:
            self.counts[name] += 1

    @property
    @override
    def rank(self) -> int:
        return self._gang.rank

    @property
    @override
    def size(self) -> int:
        return self._gang.size

    @property
    @override
    def device(self) -> torch.device:
        return self._gang.device

    @override
    def close(self) -> None:
        self._gang.close()

    @override
    def make_gang(self, ranks: Sequence[int]) -> Gang | None:
        return self._gang.make_gang(ranks)

    @override
    def as_process_group(self) -> ProcessGroup:
        return self._gang.as_process_group()

    @override
    def barrier(self) -> None:
        self._count("barrier")
        self._gang.barrier()

    @override
    def all_reduce(self, tensor: Tensor, op: ReduceOperation) -> None:
        self._count("all_reduce")
        self._gang.all_reduce(tensor, op)

    @override
    def all_reduce_async(self, tensor: Tensor, op: ReduceOperation) -> PendingCollective:
        self._count("all_reduce_async")
        return self._gang.all_reduce_async(tensor, op)

    @override
    def all_gather(self, output_tensor: Tensor, input_tensor: Tensor) -> None:
        self._count("all_gather")
        self._gang.all_gather(output_tensor, input_tensor)

    @override
    def all_gather_to_list(self, output_tensors: list[Tensor], input_tensor: Tensor) -> None:
        self._count("all_gather_to_list")
        self._gang.all_gather_to_list(output_tensors, input_tensor)

    @override
    def broadcast(self, tensor: Tensor, source_rank: int = 0) -> None:
        self._count("broadcast")
        self._gang.broadcast(tensor, source_rank)

    @override
    def broadcast_objects(self, objects: list[Any], source_rank: int = 0) -> None:
        self._count("broadcast_objects")
        self._gang.broadcast_objects(objects, source_rank)

    @override
    def all_gather_objects(self, obj: Any) -> list[Any]:
        self._count("all_gather_objects")
        return self._gang.all_gather_objects(obj)


@final
class CountSteps(TrainerCallback):
    """Counts from the start of step 1 to the end of step 6 (the final checkpoint comes after)."""

    def __init__(self, root: CountingGang, output_dir: Path) -> None:
        self._root = root
        self._output_dir = output_dir
        self.per_step: list[dict[str, int]] = []

    def on_train_begin(self, *, step_nr: int) -> None:
        self._root.counting = True

    def on_step_end(self, *, step_nr: int, metrics: object = None) -> None:
        # A step that publishes (3 and 6) ends after its publish: its counts hold both.
        self.per_step.append(dict(self._root.counts))
        self._root.counts.clear()
        if step_nr == 6:
            self._root.counting = False
            path = self._output_dir / f"rank_{self._root.rank}.json"
            path.write_text(json.dumps(self.per_step))


def count_bucket_all_reduces(root: CountingGang, bucket: dist.GradBucket) -> Future[Tensor]:
    """DDP's default reduction (torch's own ``allreduce_hook``), counted on ``root``."""
    root._count("ddp_bucket")
    return allreduce_hook(root.as_process_group(), bucket)


def count(gangs: Gangs, output_dir: Path, kind: str) -> Trainer[Any]:
    root = CountingGang(gangs.root)
    counted = Gangs(root=root, dp=gangs.dp, tp=gangs.tp, device_mesh=gangs.device_mesh)
    torch.manual_seed(0)
    model = apply_data_parallel(ToyModel(), counted, kind="fsdp" if kind == "fsdp" else "ddp")
    if kind == "ddp-hooked":
        assert isinstance(model, DistributedDataParallel)
        # A lambda: DDP checks a hook's annotations, and this module's are strings.
        model.register_comm_hook(
            root, lambda state, bucket: count_bucket_all_reduces(state, bucket)
        )
    reader = MapDataReader(
        dataset=ToyDataset(256), batch_size=2, collate=collate, gang=gangs.dp, num_accumulate=2
    )
    trainer = Trainer(
        unit=ToyUnit(model, mean_loss=False, zero_targets=False),
        data_reader=reader,
        optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
        checkpoint_manager=CheckpointManager(output_dir / "checkpoints", counted),
        gangs=counted,
        max_num_steps=6,
        publish_metrics_every_n_steps=3,
        callbacks=[CountSteps(root, output_dir)],
        progress=False,
    )
    trainer.run()
    return trainer


def count_kinds(gangs: Gangs, output_dir: Path, kinds: list[str]) -> None:
    """Count a run of each of ``kinds`` in turn, into ``output_dir/KIND``."""
    for kind in kinds:
        (output_dir / kind).mkdir(parents=True, exist_ok=True)
        count(gangs, output_dir / kind, kind).close()


def main(output_dir: Path, kinds: list[str]) -> None:
    gangs = setup_gangs()
    count_kinds(gangs, output_dir, kinds)
    leave(gangs.root)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","))
