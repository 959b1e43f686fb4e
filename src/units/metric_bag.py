"""A named set of torcheval metrics that a unit updates and the Trainer publishes."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, final

import torch
from torch import Tensor

from gangs import Gang, ReduceOperation

if TYPE_CHECKING:
    # torcheval takes a third of a second to import; a bag only calls its metrics' methods.
    from torcheval.metrics import Metric


@final
class MetricBag:
    """Holds torcheval metrics by name; read them back as attributes (``bag.nll_loss``).

    Updates are local to the process and cost no communication. :meth:`sync_and_compute` merges
    the states of every rank of a gang, which the Trainer does only when it publishes.

    A metric whose class names its states in ``summed_states`` (states that merge by elementwise
    sum, and all of its state) is merged by one all-reduce shared by every such metric, so its
    cost per rank stays flat as the gang grows; the others' states are gathered from every rank.
    """

    def __init__(self) -> None:
        self._metrics: dict[str, Metric[Any]] = {}
        self._persistent: set[str] = set()
        self._per_stage: set[str] = set()
        self._snapshot: dict[str, dict[str, Any]] | None = None
        self._device: torch.device | None = None

    def register_metric(
        self, name: str, metric: Metric[Any], persistent: bool = True, *, per_stage: bool = False
    ) -> None:
        """Add ``metric`` as ``name``; a non-persistent metric resets after each publish.

        ``per_stage``: under pipeline parallelism each stage updates its own part of the metric
        (a mixture of experts' layers), which is zero on the other stages' ranks: its
        ``summed_states`` are summed over the PP gang too (:meth:`sync_and_compute`)."""
        if per_stage and not hasattr(metric, "summed_states"):
            raise ValueError(
                f"The metric '{name}' is per_stage, so its states are summed over the pipeline "
                f"stages, but {type(metric).__name__} names no summed_states."
            )
        # "group/name" (TRL's "rewards/chosen") groups metrics in TensorBoard; such a metric is
        # read back with getattr(bag, "group/name") or bag.metrics["group/name"].
        parts = name.split("/")
        if not all(part.isidentifier() for part in parts) or name.startswith("_"):
            raise ValueError(
                "A metric name must be a public Python identifier, or such identifiers joined "
                f"by '/', but is '{name}' instead."
            )
        if name in self._metrics:
            raise ValueError(f"A metric named '{name}' is already registered in this bag.")
        self._metrics[name] = metric.to(self._device) if self._device is not None else metric
        if persistent:
            self._persistent.add(name)
        if per_stage:
            self._per_stage.add(name)

    def __getattr__(self, name: str) -> Metric[Any]:
        metrics = self.__dict__.get("_metrics", {})
        if name in metrics:
            return metrics[name]  # type: ignore[no-any-return]
        raise AttributeError(
            f"The metric bag has no metric named '{name}'. "
            f"Registered metrics: {', '.join(sorted(metrics)) or 'none'}."
        )

    @property
    def metrics(self) -> Mapping[str, Metric[Any]]:
        return self._metrics

    def to(self, device: torch.device) -> MetricBag:
        """Keep every metric's state on ``device``, and those registered later too.

        A torcheval metric keeps its state on the CPU unless it is given a device, and updating
        it with a tensor of another device fails; the Trainer moves its units' bags to the
        device it trains on.
        """
        self._device = device
        for metric in self._metrics.values():
            metric.to(device)
        return self

    def reset_metrics(self) -> None:
        for metric in self._metrics.values():
            metric.reset()

    def reset_non_persistent_metrics(self) -> None:
        for name, metric in self._metrics.items():
            if name not in self._persistent:
                metric.reset()

    def begin_updates(self) -> None:
        """Remember the current state, so the updates that follow can be rolled back."""
        self._snapshot = self._copy_states()

    def commit_updates(self) -> None:
        self._snapshot = None

    def rollback_updates(self) -> None:
        """Undo the updates since :meth:`begin_updates` (a step skipped on fp16 overflow)."""
        if self._snapshot is None:
            raise RuntimeError("rollback_updates() needs a begin_updates() before it.")
        self._load_states(self._snapshot)
        self._snapshot = None

    @contextlib.contextmanager
    def discarding_updates(self) -> Iterator[None]:
        """Undo, on leaving, every update made inside: for a forward whose values must not count.

        The states are restored in place, so a unit that keeps its own references to the
        metrics is covered too.
        """
        saved = self._copy_states()
        try:
            yield
        finally:
            self._load_states(saved)

    def _copy_states(self) -> dict[str, dict[str, Any]]:
        return {name: copy.deepcopy(metric.state_dict()) for name, metric in self._metrics.items()}

    def _load_states(self, states: dict[str, dict[str, Any]]) -> None:
        for name, state in states.items():
            self._metrics[name].load_state_dict(state)

    def sync_and_compute(self, gang: Gang, *, pp_gang: Gang | None = None) -> dict[str, Any]:
        """Merge every rank's metric states over ``gang`` and compute each metric; the
        ``per_stage`` ones over ``pp_gang`` too (one more all-reduce).

        Every rank of ``gang`` (and ``pp_gang``) must call it. 0-dim results become Python
        numbers.
        """
        if not self._metrics:
            return {}
        merged: Mapping[str, Metric[Any]] = self._metrics
        if gang.size > 1:
            summed = {n: m for n, m in self._metrics.items() if hasattr(m, "summed_states")}
            gathered = {n: m for n, m in self._metrics.items() if n not in summed}
            merged = _summed_over(gang, summed) | _gathered_over(gang, gathered)
        if pp_gang is not None and pp_gang.size > 1 and self._per_stage:
            staged = {name: merged[name] for name in sorted(self._per_stage)}
            merged = {**merged, **_summed_over(pp_gang, staged)}
        return {name: _to_python(merged[name].compute()) for name in self._metrics}

    def state_dict(self) -> dict[str, Any]:
        """The state of every metric, non-persistent ones included, so a resume is exact."""
        return {name: metric.state_dict() for name, metric in self._metrics.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if set(state_dict) != set(self._metrics):
            raise ValueError(
                f"The saved metrics {sorted(state_dict)} differ from the metrics of this bag "
                f"({sorted(self._metrics)}). Register the same metrics as the saved run."
            )
        for name, state in state_dict.items():
            metric = self._metrics[name]
            metric.load_state_dict(state)
            # A checkpoint's states come back on the CPU; keep the metric's device.
            metric.to(metric.device)


def _summed_over(gang: Gang, metrics: Mapping[str, Metric[Any]]) -> dict[str, Metric[Any]]:
    """Copies of ``metrics`` holding their states summed over ``gang``: one all-reduce of every
    state, flattened together (in float64, which sums counts exactly)."""
    if not metrics:
        return {}
    states = [(name, state) for name, m in metrics.items() for state in m.summed_states]  # type: ignore[attr-defined]
    parts = [getattr(metrics[n], state).detach().reshape(-1) for n, state in states]
    flat = torch.cat([part.to(gang.device, torch.float64) for part in parts])
    gang.all_reduce(flat, ReduceOperation.SUM)
    merged: dict[str, Metric[Any]] = {}
    totals = torch.split(flat, [part.numel() for part in parts])
    for (name, state), total in zip(states, totals, strict=True):
        metric = merged.setdefault(name, copy.deepcopy(metrics[name]))
        local = getattr(metric, state)
        setattr(metric, state, total.view_as(local).to(local))
    return merged


def _gathered_over(gang: Gang, metrics: Mapping[str, Metric[Any]]) -> dict[str, Metric[Any]]:
    """Copies of ``metrics`` merged with every other rank's states, gathered from ``gang``."""
    if not metrics:
        return {}
    states = {name: _to_cpu(m.state_dict()) for name, m in metrics.items()}
    all_states = gang.all_gather_objects(states)
    return {
        name: _merge(metric, [s[name] for r, s in enumerate(all_states) if r != gang.rank])
        for name, metric in metrics.items()
    }


def _merge(metric: Metric[Any], other_states: list[dict[str, Any]]) -> Metric[Any]:
    merged = copy.deepcopy(metric)
    others = []
    for state in other_states:
        other = copy.deepcopy(metric)
        other.load_state_dict(state)
        others.append(other.to(metric.device))
    return merged.merge_state(others)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def _to_python(value: Any) -> Any:
    if isinstance(value, Tensor) and value.numel() == 1:
        return value.item() if value.dtype != torch.bool else bool(value.item())
    return value
