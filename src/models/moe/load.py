"""How many tokens each expert of each MoE layer received, published with the train metrics.

Per MoE layer (``N``, the decoder layer's number): ``moe_tokens_min_layer_N``,
``moe_tokens_max_layer_N`` (tokens of the least and the most loaded expert),
``moe_tokens_cv_layer_N`` (the coefficient of variation of the tokens per expert: 0 when
balanced, ``sqrt(experts - 1)`` when one expert takes all) and ``moe_idle_experts_layer_N``
(experts that received none), over the steps since the last publish, summed over the DP ranks.

A forward pre-hook on each experts module keeps the routing it is given; the unit adds it to the
layer's counts after the forward (:meth:`ExpertLoad.record`), on the device, with no host sync.
The counts reach the host only where the Trainer computes its metrics. Counting after the
forward, not in the hook, keeps activation checkpointing's recomputation (in the backward) from
counting a token twice.

:class:`ExpertBiasUpdate` balances DeepSeek-V3-style routers without an auxiliary loss, from
the same counts (``model.expert_bias_update_rate``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torcheval.metrics import Metric

from gangs import Gang, ReduceOperation
from models.moe.experts import num_experts, tokens_per_expert
from units.callback import TrainerCallback
from units.metric_bag import MetricBag
from units.pipeline import inferring_shapes

_STATS = ("min", "max", "cv", "idle")
_LAYER_NUMBER = re.compile(r"layers\.(\d+)\.")

TSelf = TypeVar("TSelf", bound="ExpertTokens")


class ExpertTokens(Metric[Tensor]):
    """Tokens per expert of one MoE layer, summed over updates and ranks; computes one of
    ``min``, ``max``, ``cv`` and ``idle`` (experts with no token)."""

    summed_states = ("counts",)
    """A publish all-reduces the counts (:class:`units.MetricBag`): no per-rank cost in the DP
    size."""

    counts: Tensor

    def __init__(self, num_experts: int, stat: str, device: torch.device | None = None) -> None:
        super().__init__(device=device)
        if stat not in _STATS:
            raise ValueError(f"stat must be one of {', '.join(_STATS)}, but is '{stat}' instead.")
        self.stat = stat
        self._add_state("counts", torch.zeros(num_experts, dtype=torch.float64, device=device))

    @torch.inference_mode()
    def update(self: TSelf, counts: Tensor) -> TSelf:
        self.counts += counts.to(self.counts)
        return self

    @torch.inference_mode()
    def compute(self) -> Tensor:
        counts = self.counts
        if self.stat == "min":
            return counts.min()
        if self.stat == "max":
            return counts.max()
        if self.stat == "idle":
            return (counts == 0).sum()
        mean = counts.mean()
        return counts.std(correction=0) / mean if mean > 0 else torch.zeros((), dtype=counts.dtype)

    @torch.inference_mode()
    def merge_state(self: TSelf, metrics: Iterable[TSelf]) -> TSelf:
        for metric in metrics:
            self.counts += metric.counts.to(self.counts)
        return self


class ExpertLoad:
    """The routings of a model's MoE layers, counted into a metric bag's metrics."""

    def __init__(self, experts: list[tuple[str, nn.Module]]) -> None:
        """``experts``: each MoE layer's experts module by its qualified name."""
        self._pending: dict[int, Tensor] = {}
        self._layers: list[tuple[int, int]] = []
        self._names: dict[int, str] = {}
        self.step_counts: dict[int, Tensor] | None = None
        """Each layer's tokens per expert in the current step, when asked for
        (:meth:`count_steps`): what the aux-loss-free bias update reads."""
        for name, module in experts:
            match = _LAYER_NUMBER.search(name + ".")
            layer = int(match.group(1)) if match else len(self._layers)
            self._layers.append((layer, num_experts(module)))
            if match:
                self._names[layer] = name[: match.end(1)]
            module.register_forward_pre_hook(self._hook(layer), with_kwargs=True)
        self._metric_bag: MetricBag | None = None

    @property
    def layers(self) -> list[tuple[int, int]]:
        """Each MoE layer of the model as ``(number, experts)``."""
        return list(self._layers)

    def register(self, bag: MetricBag, *, stages: list[tuple[int, int]] | None = None) -> None:
        """Register each layer's four metrics (non-persistent: they restart at each publish).

        ``stages``: under pipeline parallelism, the MoE layers of every stage (each rank
        registers them all, so that every rank publishes them; a rank counts its own layers,
        and a publish sums each over the PP gang: ``per_stage``)."""
        for layer, count in sorted(set(self._layers) | set(stages or ())):
            for stat in _STATS:
                metric = ExpertTokens(count, stat)
                name = _metric_name(stat, layer)
                bag.register_metric(name, metric, persistent=False, per_stage=stages is not None)
        self._metric_bag = bag

    def record_after_layers(self, model: nn.Module) -> None:
        """Count each MoE layer's routings after its own forward (a hook on the decoder layer),
        not after the whole model's: under pipeline parallelism the schedule runs the stages,
        and the unit's forward never runs. An activation checkpoint's recomputation calls the
        layer's inner forward, which fires no hook of the layer: nothing is counted twice."""
        for layer, count in self._layers:
            module = model.get_submodule(self._names[layer])
            module.register_forward_hook(self._record_hook(layer, count))

    def _record_hook(self, layer: int, count: int) -> Any:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            # A valid pass runs without gradients: its routings count for nothing here, as
            # without pipeline parallelism (where the unit's forward alone records); nor do a
            # forward's that only infers the activations' shapes.
            if torch.is_grad_enabled() and not inferring_shapes():
                self._record(layer, count)
            else:
                self._pending.pop(layer, None)

        return record

    def count_steps(self) -> None:
        """Also count each step's tokens per expert into :attr:`step_counts`."""
        self.step_counts = {}

    def _hook(self, layer: int) -> Any:
        def keep(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            self._pending[layer] = index.detach()

        return keep

    def begin(self) -> None:
        """Forget routings kept since the last forward (a recomputation's)."""
        self._pending.clear()

    def record(self) -> None:
        """Add the routings of the forward that just ran to the metrics."""
        for layer, count in self._layers:
            self._record(layer, count)

    def _record(self, layer: int, count: int) -> None:
        assert self._metric_bag is not None  # register
        index = self._pending.pop(layer, None)
        if index is None:
            return
        counts = tokens_per_expert(index, count, torch.float32)
        for stat in _STATS:
            getattr(self._metric_bag, _metric_name(stat, layer)).update(counts)
        if self.step_counts is not None:
            if layer in self.step_counts:
                self.step_counts[layer] += counts
            else:
                self.step_counts[layer] = counts


def _metric_name(stat: str, layer: int) -> str:
    return f"moe_{'idle_experts' if stat == 'idle' else 'tokens_' + stat}_layer_{layer}"


class ExpertBiasUpdate(TrainerCallback):
    """Load balancing without an auxiliary loss (DeepSeek-V3, torchtitan): before each optimizer
    step, each router's ``e_score_correction_bias`` moves by ``rate`` towards the experts that
    received fewer tokens than the mean in this step over all DP ranks, and away from those that
    received more (``rate * sign(mean - tokens)``, centred). The bias only chooses the experts;
    the routing weights stay the scores'.

    The bias is a buffer of the model, so checkpoints hold it and a resume continues from it.
    The step's counts are summed over the DP gang with one all-reduce a step, on the device."""

    def __init__(
        self, load: ExpertLoad, biases: dict[int, Tensor], dp_gang: Gang, rate: float
    ) -> None:
        self._load, self._biases, self._gang, self._rate = load, biases, dp_gang, rate
        load.count_steps()

    def on_step_begin(self, *, step_nr: int, batches: Sequence[Any]) -> None:
        assert self._load.step_counts is not None  # count_steps
        self._load.step_counts.clear()  # a skipped step's counts are not carried over

    def on_before_optimizer_step(self, *, step_nr: int, model: nn.Module) -> None:
        counts = self._load.step_counts
        assert counts is not None
        layers = sorted(layer for layer in self._biases if layer in counts)
        if not layers:
            return
        stacked = torch.stack([counts[layer] for layer in layers])
        if self._gang.size > 1:
            self._gang.all_reduce(stacked, ReduceOperation.SUM)
        delta = self._rate * torch.sign(stacked.mean(dim=1, keepdim=True) - stacked)
        delta -= delta.mean(dim=1, keepdim=True)
        with torch.no_grad():
            for row, layer in enumerate(layers):
                bias = self._biases[layer]
                bias.add_(delta[row].to(bias))


def correction_biases(model: nn.Module) -> dict[int, Tensor]:
    """The ``e_score_correction_bias`` of each MoE layer's router, by layer number."""
    found = {}
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            match = _LAYER_NUMBER.search(name)
            if match:
                found[int(match.group(1))] = buffer
    return found
