from __future__ import annotations

from typing import Any

import pytest
import torch
from torcheval.metrics import Mean, Sum

from benchmarks.stand_in_gang import RankGang
from gangs import FakeGang, ReduceOperation
from units import MetricBag


def make_bag() -> MetricBag:
    bag = MetricBag()
    bag.register_metric("nll_loss", Mean(), persistent=False)
    bag.register_metric("num_examples", Sum())
    return bag


def test_metrics_read_back_as_attributes() -> None:
    bag = make_bag()
    bag.nll_loss.update(torch.tensor(2.0), weight=3)
    bag.nll_loss.update(torch.tensor(4.0), weight=1)
    bag.num_examples.update(torch.tensor(5.0))
    assert bag.sync_and_compute(FakeGang()) == {"nll_loss": 2.5, "num_examples": 5.0}


def test_unknown_metric_names_the_registered_ones() -> None:
    with pytest.raises(
        AttributeError,
        match=r"no metric named 'accuracy'\. Registered metrics: nll_loss, num_examples",
    ):
        _ = make_bag().accuracy


def test_bad_and_duplicate_names_are_rejected() -> None:
    bag = make_bag()
    with pytest.raises(ValueError, match="already registered"):
        bag.register_metric("nll_loss", Mean())
    with pytest.raises(ValueError, match="joined by '/', but is 'bad-name'"):
        bag.register_metric("bad-name", Mean())
    with pytest.raises(ValueError, match="but is 'rewards/'"):
        bag.register_metric("rewards/", Mean())


def test_a_grouped_name_is_registered_read_back_and_computed() -> None:
    bag = make_bag()
    bag.register_metric("rewards/chosen", Mean())
    getattr(bag, "rewards/chosen").update(torch.tensor(2.0))
    assert bag.sync_and_compute(FakeGang())["rewards/chosen"] == 2.0


def test_only_non_persistent_metrics_reset_after_publish() -> None:
    bag = make_bag()
    bag.nll_loss.update(torch.tensor(1.0))
    bag.num_examples.update(torch.tensor(7.0))
    bag.reset_non_persistent_metrics()
    bag.nll_loss.update(torch.tensor(3.0))
    assert bag.sync_and_compute(FakeGang()) == {"nll_loss": 3.0, "num_examples": 7.0}


def test_rolled_back_updates_do_not_count() -> None:
    bag = make_bag()
    bag.num_examples.update(torch.tensor(1.0))
    bag.begin_updates()
    bag.num_examples.update(torch.tensor(100.0))
    bag.rollback_updates()
    bag.begin_updates()
    bag.num_examples.update(torch.tensor(2.0))
    bag.commit_updates()
    assert bag.sync_and_compute(FakeGang())["num_examples"] == 3.0


def test_updates_inside_discarding_updates_do_not_count() -> None:
    bag = make_bag()
    kept = bag.num_examples  # a unit may keep its own reference to a metric
    bag.num_examples.update(torch.tensor(1.0))
    with bag.discarding_updates():
        kept.update(torch.tensor(100.0))
        bag.nll_loss.update(torch.tensor(9.0))
    with pytest.raises(RuntimeError, match="broken"), bag.discarding_updates():
        kept.update(torch.tensor(100.0))
        raise RuntimeError("broken")
    bag.nll_loss.update(torch.tensor(2.0))
    assert bag.sync_and_compute(FakeGang()) == {"nll_loss": 2.0, "num_examples": 1.0}


def test_rollback_without_begin_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="begin_updates"):
        make_bag().rollback_updates()


def test_state_dict_round_trip_restores_every_metric() -> None:
    bag = make_bag()
    bag.nll_loss.update(torch.tensor(2.0), weight=2)
    bag.num_examples.update(torch.tensor(4.0))
    restored = make_bag()
    restored.load_state_dict(bag.state_dict())
    assert restored.sync_and_compute(FakeGang()) == bag.sync_and_compute(FakeGang())


def test_state_of_other_metrics_is_rejected() -> None:
    other = MetricBag()
    other.register_metric("accuracy", Mean())
    with pytest.raises(ValueError, match="Register the same metrics"):
        make_bag().load_state_dict(other.state_dict())


def _state_devices(bag: MetricBag) -> set[torch.device]:
    return {
        value.device
        for metric in bag.metrics.values()
        for value in metric.state_dict().values()
        if isinstance(value, torch.Tensor)
    } | {metric.device for metric in bag.metrics.values()}


def test_to_moves_every_metric_and_keeps_them_there() -> None:
    """The bag's metrics stay on its device: those registered after to(), and states loaded
    from a checkpoint (on the CPU)."""
    meta = torch.device("meta")
    bag = make_bag()
    saved = make_bag().state_dict()
    assert bag.to(meta) is bag
    bag.register_metric("later", Sum())
    assert _state_devices(bag) == {meta}
    saved["later"] = Sum().state_dict()
    bag.load_state_dict(saved)
    assert _state_devices(bag) == {meta}


class _SummedSum(Sum):
    summed_states = ("weighted_sum",)


class _TwoRanks(RankGang):
    """Rank 0 of 2, the other rank's metrics given: sums add its states, a gather returns them
    (``gathers`` counts the gathers)."""

    def __init__(self, other: MetricBag) -> None:
        super().__init__(rank=0, size=2)
        self._other = other
        self.gathers = 0

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOperation) -> None:
        assert op is ReduceOperation.SUM
        others = [
            getattr(m, state).double().reshape(-1)
            for m in self._other.metrics.values()
            for state in getattr(m, "summed_states", ())
        ]
        tensor += torch.cat(others)

    def all_gather_objects(self, obj: Any) -> list[Any]:
        self.gathers += 1
        return [obj, {name: m.state_dict() for name, m in self._other.metrics.items()}]


def test_summed_metrics_merge_by_one_all_reduce_and_the_others_by_gathering() -> None:
    """A metric whose states are sums (``summed_states``) is merged without gathering every
    rank's states, so a publish costs a rank the same at any DP size; the totals are those of
    gathering."""

    def bag_of(values: list[float], loss: float) -> MetricBag:
        bag = MetricBag()
        bag.register_metric("tokens", _SummedSum())
        bag.register_metric("nll_loss", Mean())
        for value in values:
            bag.tokens.update(torch.tensor(value))
        bag.nll_loss.update(torch.tensor(loss))
        return bag

    mine, other = bag_of([1.0, 2.0], 3.0), bag_of([10.0], 5.0)
    gang = _TwoRanks(other)
    assert mine.sync_and_compute(gang) == {"tokens": 13.0, "nll_loss": 4.0}
    assert gang.gathers == 1  # for the mean only
    assert mine.tokens.compute().item() == 3.0  # the local state is left as it was

    only_summed = MetricBag()
    only_summed.register_metric("tokens", _SummedSum())
    only_summed.tokens.update(torch.tensor(4.0))
    other_summed = MetricBag()
    other_summed.register_metric("tokens", _SummedSum())
    other_summed.tokens.update(torch.tensor(6.0))
    gang = _TwoRanks(other_summed)
    assert only_summed.sync_and_compute(gang) == {"tokens": 10.0}
    assert gang.gathers == 0


def test_per_stage_metrics_are_summed_over_the_pipeline_stages_too() -> None:
    """Under pipeline parallelism a stage updates only its own layers' metrics: a per-stage
    metric is summed over the PP gang as well, so every rank computes the totals; the others
    (the loss every rank records) are left as the DP gang merged them."""

    def bag_of(tokens: float, loss: float) -> MetricBag:
        bag = MetricBag()
        bag.register_metric("tokens_layer_1", _SummedSum(), per_stage=True)
        bag.register_metric("nll_loss", Mean())
        bag.tokens_layer_1.update(torch.tensor(tokens))
        bag.nll_loss.update(torch.tensor(loss))
        return bag

    stage_0, stage_1 = bag_of(0.0, 3.0), bag_of(7.0, 3.0)
    pp_gang = _TwoRanks(stage_1)
    values = stage_0.sync_and_compute(FakeGang(), pp_gang=pp_gang)
    assert values == {"tokens_layer_1": 7.0, "nll_loss": 3.0}
    assert pp_gang.gathers == 0
    assert stage_0.sync_and_compute(FakeGang()) == {"tokens_layer_1": 0.0, "nll_loss": 3.0}
    with pytest.raises(ValueError, match=r"^The metric 'loss' is per_stage, .* names no summed_"):
        stage_0.register_metric("loss", Mean(), per_stage=True)
