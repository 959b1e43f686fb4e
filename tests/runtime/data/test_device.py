"""Batches and models on the gangs' device (the ``meta`` device stands in for a GPU here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor, nn

from gangs import Gangs
from runtime import apply_data_parallel
from runtime.data import DeviceDataReader, MapDataReader, move_to_device
from runtime.parallel.placement import check_model_device
from tests.conftest import make_toy_trainer

META = torch.device("meta")


class Pair(NamedTuple):
    inputs: Tensor
    label: str


@dataclass(frozen=True)
class Frozen:
    tokens: Tensor
    lengths: list[Tensor]
    num_targets: int


class Movable:
    def __init__(self) -> None:
        self.moved_to: list[tuple[torch.device, bool]] = []

    def to(self, device: torch.device, *, non_blocking: bool = False) -> Movable:
        self.moved_to.append((device, non_blocking))
        return self


def test_every_tensor_inside_a_batch_moves_and_other_leaves_stay() -> None:
    movable = Movable()
    batch: dict[str, Any] = {
        "x": torch.ones(2),
        "pairs": [Pair(torch.zeros(1), "a"), (torch.ones(3), 7)],
        "frozen": Frozen(torch.arange(4), [torch.ones(1)], num_targets=4),
        "movable": movable,
        "name": "batch 1",
    }
    moved = move_to_device(batch, META)
    assert moved["x"].device == META
    first, second = moved["pairs"]
    assert isinstance(first, Pair) and first.inputs.device == META and first.label == "a"
    assert isinstance(second, tuple) and second[0].device == META and second[1] == 7
    frozen = moved["frozen"]
    assert isinstance(frozen, Frozen) and frozen.tokens.device == META
    assert frozen.lengths[0].device == META and frozen.num_targets == 4
    assert moved["movable"] is movable and movable.moved_to == [(META, True)]
    assert moved["name"] == "batch 1"
    # The batch the reader made is left as it was.
    assert batch["x"].device.type == "cpu" and batch["frozen"].tokens.device.type == "cpu"


def test_a_tensor_already_on_the_device_is_not_copied() -> None:
    tensor = torch.ones(3)
    assert move_to_device({"x": tensor}, torch.device("cpu"))["x"] is tensor


def test_the_device_reader_moves_each_micro_batch_and_keeps_the_position() -> None:
    gang = Gangs.single().dp
    reader = MapDataReader(
        dataset=torch.utils.data.TensorDataset(torch.arange(12.0)),
        batch_size=2,
        gang=gang,
        num_accumulate=2,
        shuffle=False,
    )
    on_device = DeviceDataReader(reader, META)
    batches = next(on_device)
    assert len(batches) == 2 and all(b[0].device == META for b in batches)
    assert on_device.state_dict() == reader.state_dict()
    assert on_device.num_accumulate == 2
    evaluation = on_device.for_evaluation()
    assert all(b[0].device == META for batches in evaluation for b in batches)
    on_device.close()


def test_a_model_on_another_device_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"'weight' is on cpu, but the gangs' device is meta\. "):
        check_model_device(nn.Linear(2, 2), META)
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"still on the meta device\. Materialize the model"):
        check_model_device(model, torch.device("cpu"))


def test_the_trainer_refuses_a_model_on_another_device(tmp_path: Any) -> None:
    with torch.device("meta"):
        model = nn.Linear(8, 4)
    with pytest.raises(ValueError, match="still on the meta device"):
        make_toy_trainer(tmp_path, model=model)


def test_apply_data_parallel_leaves_the_model_on_the_gangs_device() -> None:
    model = apply_data_parallel(nn.Linear(2, 2), Gangs.single(device=META), kind="ddp")
    assert all(p.device == META for p in model.parameters())


def _numbers(dataset_size: int = 20) -> MapDataReader[Any]:
    return MapDataReader(
        dataset=torch.utils.data.TensorDataset(torch.arange(float(dataset_size))),
        batch_size=2,
        gang=Gangs.single().dp,
        num_accumulate=2,
        shuffle=True,
        seed=3,
    )


def _read_epoch(reader: Any) -> list[list[float]]:
    return [[v for batch in batches for v in batch[0].tolist()] for batches in reader]


def test_reading_ahead_hands_out_the_same_steps_and_ends_the_epoch_at_the_same_step() -> None:
    ahead = DeviceDataReader(_numbers(), torch.device("cpu"), read_ahead=True)
    expected = _numbers()
    for _ in range(2):  # two epochs: reset drops nothing and reads nothing twice
        assert _read_epoch(ahead) == _read_epoch(expected)
        with pytest.raises(StopIteration):  # and keeps raising it until reset
            next(ahead)
        ahead.reset()
        expected.reset()


def test_reading_ahead_saves_the_position_of_the_steps_handed_out() -> None:
    ahead = DeviceDataReader(_numbers(), torch.device("cpu"), read_ahead=True)
    plain = _numbers()
    for _ in range(2):
        next(ahead)
        next(plain)
    # The reader underneath is a step further; the saved position is the loop's.
    assert ahead.reader.state_dict() != plain.state_dict()
    state = ahead.state_dict()
    assert state == plain.state_dict()

    resumed = DeviceDataReader(_numbers(), torch.device("cpu"), read_ahead=True)
    next(resumed)  # a position read ahead of is replaced by the loaded one
    resumed.load_state_dict(state)
    assert _read_epoch(resumed) == _read_epoch(plain)


def test_evaluation_reads_ahead_like_training() -> None:
    ahead = DeviceDataReader(_numbers(21), torch.device("cpu"), read_ahead=True)
    evaluation = ahead.for_evaluation()
    assert isinstance(evaluation, DeviceDataReader)
    # Every example once, the last partial micro-batch kept.
    examples = [value for step in _read_epoch(evaluation) for value in step]
    assert sorted(examples) == [float(i) for i in range(21)]


def test_tensor_devices_finds_every_tensor_move_to_device_moves() -> None:
    from runtime.data.device import tensor_devices

    batch = {
        "pair": Pair(torch.zeros(2, device=META), "a"),
        "frozen": Frozen(torch.zeros(1), [torch.zeros(1, device=META)], 3),
    }
    assert tensor_devices(batch) == {torch.device("cpu"), META}
    assert tensor_devices(move_to_device(batch, META)) == {META}
    assert tensor_devices({"label": "no tensor", "movable": Movable()}) == set()
