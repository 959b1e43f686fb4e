"""Pipeline-parallel runs of a tiny Llama in one ``torchrun`` launch, for tests/runtime/parallel/
test_pipeline.py.

Usage: ``torchrun --nproc-per-node 2 tests/workers/pipeline_checks.py OUT``. Each run of
:data:`RUNS` trains under ``gang.pp_size=2`` into ``OUT/NAME`` (metrics, checkpoints), and each
rank saves its part's weights to ``OUT/NAME/part_R.pt``. :func:`train` is also the one-process
reference the tests compare with (``pp_size`` 1).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from checkpoint import CheckpointManager
from gangs import Gangs, setup_gangs
from models.llama import Llama, LlamaArgs
from models.pipeline import split_model
from runtime import MapDataReader, Trainer
from runtime.parallel.pipeline import Pipeline, stage_ids
from tests.workers.leave import leave
from units.lm import LMEvalUnit, LMTrainUnit

ARGS = LlamaArgs(
    vocab_size=32, dim=16, num_layers=4, num_heads=2, num_kv_heads=1, ffn_dim=32, max_seq_len=8
)
SEQ_LEN = 8

RUNS: dict[str, dict[str, Any]] = {
    # Gradient accumulation (2 micro-batches a step, each split into pipeline microbatches),
    # clipping that bites, a valid set of 5 batches that no layout splits evenly.
    "1f1b": {"schedule": "1f1b", "num_microbatches": 2},
    "interleaved_1f1b": {
        "schedule": "interleaved_1f1b",
        "stages_per_rank": 2,
        "num_microbatches": 2,
    },
    "gpipe": {"schedule": "gpipe", "num_microbatches": 4},
    # torch's V-shaped schedules cannot run forward only: no valid set.
    "zbv": {"schedule": "zbv", "stages_per_rank": 2, "num_microbatches": 4, "valid": False},
    "dualpipev": {
        "schedule": "dualpipev",
        "stages_per_rank": 2,
        "num_microbatches": 4,
        "valid": False,
    },
    # Saved at step 2 (of 4) for the resume at pp_size 1.
    "resume": {"schedule": "1f1b", "num_microbatches": 2, "max_num_steps": 2},
}
NUM_STEPS = 4


@dataclass
class Batch:
    input_ids: Tensor
    target_ids: Tensor
    num_targets: int

    @property
    def batch_size(self) -> int:
        return self.input_ids.size(0)


class Tokens(torch.utils.data.Dataset[Tensor]):
    def __init__(self, size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, ARGS.vocab_size, (size, SEQ_LEN + 1), generator=gen)
        # Every third example has its last half masked out, so batches differ in targets.
        self.tokens[::3, SEQ_LEN // 2 + 1 :] = -100

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> Tensor:
        return self.tokens[index]


def collate(examples: list[Tensor]) -> Batch:
    tokens = torch.stack(examples)
    inputs = tokens[:, :-1].clamp(min=0)
    targets = tokens[:, 1:]
    return Batch(inputs, targets, int((targets != -100).sum()))


def whole_model() -> Llama:
    torch.manual_seed(0)
    model = Llama(ARGS)
    return model


def train(
    gangs: Gangs,
    output_dir: Path,
    options: dict[str, Any],
    *,
    resume_from: Path | None = None,
    max_num_steps: int | None = None,
) -> dict[str, Tensor]:
    """One run; returns this rank's weights (its part's under pipeline parallelism)."""
    model: nn.Module = whole_model()
    pipeline = None
    if gangs.pp.size > 1:
        schedule = options["schedule"]
        per_rank = options.get("stages_per_rank", 1)
        ids = stage_ids(
            schedule, pp_rank=gangs.pp.rank, pp_size=gangs.pp.size, stages_per_rank=per_rank
        )
        stages, model = split_model(model, ids, gangs.pp.size * per_rank)
        pipeline = Pipeline(
            stages=stages,
            part=model,
            ids=ids,
            gangs=gangs,
            schedule=schedule,
            num_microbatches=options["num_microbatches"],
        )
    reader = MapDataReader(
        dataset=Tokens(24, seed=1),
        batch_size=4,
        collate=collate,
        gang=gangs.dp,
        num_accumulate=2,
        seed=3,
    )
    valid = options.get("valid", True)
    valid_reader = MapDataReader(
        dataset=Tokens(20, seed=2), batch_size=4, collate=collate, gang=gangs.dp, seed=3
    )
    trainer = Trainer(
        unit=LMTrainUnit(model),
        data_reader=reader,
        optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
        checkpoint_manager=CheckpointManager(output_dir / "checkpoints", gangs),
        gangs=gangs,
        valid_units=[LMEvalUnit(model)] if valid else None,
        valid_data_readers=[valid_reader] if valid else None,
        validate_every_n_steps=2 if valid else None,
        max_num_steps=max_num_steps or options.get("max_num_steps", NUM_STEPS),
        max_gradient_norm=0.5,
        publish_metrics_every_n_steps=1,
        metrics_dir=output_dir / "metrics",
        checkpoint_every_n_steps=2,
        reshard_on_resume=resume_from is not None,
        resume_from=resume_from,
        progress=False,
        pipeline=pipeline,
    )
    trainer.run()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def main(output_dir: Path) -> None:
    gangs = setup_gangs(pp_size=2)
    for name, options in RUNS.items():
        run_dir = output_dir / name
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            part = train(gangs, run_dir, options)
        except BaseException as ex:
            ex.add_note(f"(in pipeline_checks.py's run {name})")
            raise
        torch.save(part, run_dir / f"part_{gangs.root.rank}.pt")
    (output_dir / f"gangs_{gangs.root.rank}.json").write_text(
        json.dumps({"repr": repr(gangs), "pp_rank": gangs.pp.rank, "dp": gangs.dp.size})
    )
    leave(gangs.root)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
