"""A small LM trained on a prepared dataset, recording the sequences each step read, for the
resume-at-another-DP-size test (``tests/runtime/data/test_prepared_resume.py``).

Usage: ``torchrun --nproc-per-node 2 tests/workers/prepared_resume.py DATA [OUT:STEPS]...``;
each ``OUT:STEPS`` trains (or resumes) the run in OUT to STEPS steps with a global batch of
``GLOBAL_BATCH`` sequences, one after another in the same launch. A run writes the sequence ids
of its steps to ``OUT/sequences_to_STEPS_rank_R.json`` and its full parameters to ``OUT/params.pt``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import final

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from checkpoint import CheckpointManager
from gangs import Gangs, setup_gangs
from runtime import Trainer, apply_data_parallel
from runtime.data.text import PreparedDataReader, TextBatch
from tests.workers.leave import leave
from tests.workers.resume_toy import save_full_params
from units import TrainUnit

GLOBAL_BATCH = 6
SEQ_LEN = 16


@final
class RecordingUnit(TrainUnit[TextBatch]):
    """Next-token loss, summed; keeps the sequence ids each step read."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.sequences: dict[int, list[int]] = {}
        self._step_nr = 0

    def set_step_nr(self, step_nr: int) -> None:
        self._step_nr = step_nr

    def __call__(self, batch: TextBatch) -> tuple[Tensor, int | None]:
        assert batch.sequence_ids is not None
        self.sequences.setdefault(self._step_nr, []).extend(batch.sequence_ids.tolist())
        logits = self.model(batch.input_ids)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.target_ids.flatten(), reduction="sum")
        return loss, batch.num_targets


def train(data: Path, output_dir: Path, max_num_steps: int, gangs: Gangs) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(258, 16), nn.Linear(16, 258))
    model = apply_data_parallel(model, gangs, kind="ddp")
    unit = RecordingUnit(model)
    reader = PreparedDataReader(
        sources=data,
        seq_len=SEQ_LEN,
        batch_size=GLOBAL_BATCH // gangs.dp.size,
        gang=gangs.dp,
        num_accumulate=1,
        seed=3,
    )
    trainer = Trainer(
        unit=unit,
        data_reader=reader,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        checkpoint_manager=CheckpointManager(output_dir / "checkpoints", gangs),
        gangs=gangs,
        dtype=torch.float32,
        max_num_steps=max_num_steps,
        checkpoint_every_n_steps=3,
        reshard_on_resume=True,
        seed=0,
    )
    trainer.run()
    rank = gangs.root.rank
    record = output_dir / f"sequences_to_{max_num_steps}_rank_{rank}.json"
    record.write_text(json.dumps(unit.sequences))
    save_full_params(model, gangs, output_dir / "params.pt")


def main(data: Path, runs: list[str]) -> None:
    gangs = setup_gangs()
    for run in runs:
        output_dir, steps = run.rsplit(":", 1)
        train(data, Path(output_dir), int(steps), gangs)
    leave(gangs.root)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
