"""Several init_from sources, each with its own renames and skips, and reloading them while
training (a model bank another run keeps exporting into)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from gangs import Gangs
from runtime import (
    InitialWeightsError,
    InitSource,
    ReloadInitialWeights,
    TrainerCallback,
    load_initial_weights,
)
from tests.conftest import ListRecorder, assert_ok, make_toy_trainer, torchrun
from tests.workers.train_toy import ToyModel


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)


def save(state: dict[str, Tensor], path: Path) -> Path:
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    partial.replace(path)  # as export writes: whole or absent
    return path


def test_each_source_sets_its_part_with_its_own_renames(tmp_path: Path) -> None:
    torch.manual_seed(0)
    encoder_run, head_bank = Pair(), Pair()
    save({"enc." + k: v for k, v in encoder_run.encoder.state_dict().items()}, tmp_path / "a.pt")
    save(head_bank.state_dict(), tmp_path / "b.pt")
    model = Pair()
    loaded = load_initial_weights(
        model,
        [
            InitSource(tmp_path / "a.pt", rename={"enc.": "encoder."}),
            InitSource(tmp_path / "b.pt", skip=["encoder.*"]),
        ],
        gangs=Gangs.single(),
    )
    assert loaded.sources == (tmp_path / "a.pt", tmp_path / "b.pt")
    assert torch.equal(model.encoder.weight, encoder_run.encoder.weight)
    assert torch.equal(model.head.weight, head_bank.head.weight)
    assert set(loaded.loaded_keys) == set(model.state_dict())


def test_a_key_from_two_sources_or_from_none_is_an_error(tmp_path: Path) -> None:
    save(Pair().state_dict(), tmp_path / "a.pt")
    save(Pair().state_dict(), tmp_path / "b.pt")
    save({"head.weight": torch.zeros(2, 4)}, tmp_path / "head.pt")
    with pytest.raises(InitialWeightsError, match=r"come from both .*a\.pt and .*b\.pt"):
        load_initial_weights(Pair(), [tmp_path / "a.pt", tmp_path / "b.pt"], gangs=Gangs.single())
    save({"head.bias": torch.zeros(2)}, tmp_path / "bias.pt")
    with pytest.raises(InitialWeightsError, match=r"No source of init_from sets 2 model keys"):
        load_initial_weights(
            Pair(), [tmp_path / "head.pt", tmp_path / "bias.pt"], gangs=Gangs.single()
        )
    # Skipped by a source: the encoder keeps its initialization.
    load_initial_weights(
        Pair(),
        [InitSource(tmp_path / "head.pt", skip=["encoder.*"]), tmp_path / "bias.pt"],
        gangs=Gangs.single(),
    )


class SecondRunExports(TrainerCallback):
    """After ``at_step``, another run exports new weights into the bank."""

    def __init__(self, bank: Path, weights: dict[str, Tensor], at_step: int) -> None:
        self._bank, self._weights, self._at_step = bank, weights, at_step

    def on_step_end(self, *, step_nr: int, **_: object) -> None:
        if step_nr == self._at_step:
            save(self._weights, self._bank)


class Snapshot(TrainerCallback):
    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self.after_step: dict[int, dict[str, Tensor]] = {}

    def on_step_end(self, *, step_nr: int, **_: object) -> None:
        self.after_step[step_nr] = {k: v.clone() for k, v in self._model.state_dict().items()}


def test_a_run_reloads_the_bank_another_run_exports_into(tmp_path: Path) -> None:
    torch.manual_seed(1)
    first, second = ToyModel().state_dict(), ToyModel().state_dict()
    bank = save(first, tmp_path / "bank.pt")
    model, recorder = ToyModel(), ListRecorder()
    reload = ReloadInitialWeights(
        model, bank, gangs=Gangs.single(), every_n_steps=2, recorders=[recorder]
    )
    snapshot = Snapshot(model)
    trainer = make_toy_trainer(
        tmp_path,
        model=model,
        max_num_steps=6,
        callbacks=[SecondRunExports(bank, second, at_step=3), reload, snapshot],
    )
    trainer.run()
    trainer.close()

    for key in first:
        assert torch.equal(snapshot.after_step[2][key], first[key])
        assert torch.equal(snapshot.after_step[4][key], second[key])
        assert torch.equal(snapshot.after_step[6][key], second[key])
        assert not torch.equal(snapshot.after_step[3][key], second[key])  # trained on
    assert [(run, values["num_reloads"], step) for run, values, step in recorder.records] == [
        ("init_reload", 1, 2),
        ("init_reload", 2, 4),
        ("init_reload", 3, 6),
    ]
    assert reload.state_dict() == {"num_reloads": 3}


WORKER = Path(__file__).with_name("weight_reload_worker.py")


@pytest.mark.distributed
def test_every_rank_reloads_the_same_weights_at_the_same_step(tmp_path: Path) -> None:
    torch.manual_seed(2)
    save(ToyModel().state_dict(), tmp_path / "bank.pt")
    assert_ok(torchrun(2, str(WORKER), str(tmp_path), timeout=300))
    expected = torch.load(tmp_path / "bank.pt", weights_only=True)
    for rank in range(2):
        after = torch.load(tmp_path / f"after_{rank}.pt", weights_only=True)
        assert after.keys() == expected.keys()
        assert all(torch.equal(after[k], expected[k]) for k in expected)


def test_the_bank_reloads_at_the_end_of_every_data_epoch(tmp_path: Path) -> None:
    bank = save(ToyModel().state_dict(), tmp_path / "bank.pt")
    model, recorder = ToyModel(), ListRecorder()
    reload = ReloadInitialWeights(
        model, bank, gangs=Gangs.single(), every_n_data_epochs=1, recorders=[recorder]
    )
    # 32 examples in steps of 4: a data epoch of 8 steps.
    trainer = make_toy_trainer(tmp_path, model=model, max_num_steps=20, callbacks=[reload])
    trainer.run()
    trainer.close()
    assert [step for _, _, step in recorder.records] == [8, 16]
    with pytest.raises(ValueError, match="needs every_n_steps or every_n_data_epochs"):
        ReloadInitialWeights(model, bank, gangs=Gangs.single())
