"""Preference tuning: DPO, SimPO, ORPO and CPO as train units.

Each unit computes, for a batch of pairs (:class:`PairBatch`, e.g.
``runtime.data.text.PairBatch``), one loss per pair and returns their SUM with the number
of pairs, so the Trainer's normalization makes each update the exact mean over the step's pairs,
across gradient accumulation and data-parallel ranks. The metrics are TRL's:
``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
``logps/chosen`` and ``logps/rejected``, means over the pairs.

- :class:`DpoTrainUnit` holds the policy and a :class:`~units.reference.Reference`: a frozen
  copy of the initial weights, the policy with its LoRA adapters disabled, or log-probabilities
  computed once. Loss types as TRL's ``DPOTrainer``: sigmoid, hinge, ipo (length-normalized as
  TRL does) and robust.
- :class:`SimpoTrainUnit` (TRL's ``CPOTrainer`` with ``loss_type="simpo"``, ``cpo_alpha=0``),
  :class:`OrpoTrainUnit` (TRL's ``ORPOTrainer``) and :class:`CpoTrainUnit` (``CPOTrainer``'s
  sigmoid loss) use no reference.

See docs/preference.md for the data, the options and the comparison with TRL.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torcheval.metrics import Max, Mean

from trainkit_utils.arguments import check_positive
from units.lm import IGNORE_INDEX, logits_of
from units.metric_bag import MetricBag
from units.reference import PairBatch, Reference, sequence_logps
from units.unit import EvalUnit, TrainUnit

PreferenceTask = Literal["dpo", "simpo", "orpo", "cpo"]
PREFERENCE_TASKS: tuple[PreferenceTask, ...] = ("dpo", "simpo", "orpo", "cpo")

DpoLossType = Literal["sigmoid", "hinge", "ipo", "robust"]

PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


@dataclass
class PreferenceOptions:
    """The methods' options, with TRL's meanings; each unit reads those of its method."""

    beta: float = 0.1
    """DPO's and SimPO's beta; ORPO's lambda (TRL calls both beta). Rewards are beta * logps."""
    loss_type: DpoLossType = "sigmoid"
    """DPO's loss: sigmoid, hinge, ipo or robust, as TRL's DPOTrainer computes them."""
    label_smoothing: float = 0.0
    """The probability that a pair's labels are flipped (DPO's robust loss, SimPO, CPO)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma."""
    cpo_alpha: float = 1.0
    """CPO's weight of the chosen completion's NLL."""

    def validate(self) -> None:
        check_positive("preference.beta", self.beta)
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(
                "preference.label_smoothing must be at least 0 and below 0.5, but is "
                f"{self.label_smoothing} instead."
            )


# ----------------------------------------------------------------------------- math


def whole_sequence_targets(batch: PairBatch) -> Tensor:
    """Each row's next tokens over its prompt and completion; ``IGNORE_INDEX`` on padding (the
    positions after the row's last completion target)."""
    targets = torch.full_like(batch.input_ids, IGNORE_INDEX)
    targets[:, :-1] = batch.input_ids[:, 1:]
    positions = torch.arange(targets.size(1), device=targets.device)
    is_completion = batch.target_ids != IGNORE_INDEX
    last = torch.where(is_completion, positions, -1).amax(dim=1, keepdim=True)
    return targets.masked_fill(positions > last, IGNORE_INDEX)


class PairOutput(NamedTuple):
    """One value per pair: the loss, TRL's rewards and log-probabilities, and the method's own
    metrics (``extra``)."""

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor
    chosen_logps: Tensor
    rejected_logps: Tensor
    extra: dict[str, Tensor]


def dpo_losses(
    chosen_logratios: Tensor,
    rejected_logratios: Tensor,
    counts: Tensor,
    options: PreferenceOptions,
) -> Tensor:
    """TRL's DPO losses per pair; ``counts`` are the completion lengths (ipo normalizes by them)."""
    beta, smoothing = options.beta, options.label_smoothing
    delta = chosen_logratios - rejected_logratios
    if options.loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if options.loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if options.loss_type == "ipo":
        chosen_counts, rejected_counts = counts.clamp(min=1).chunk(2)
        ipo_delta = chosen_logratios / chosen_counts - rejected_logratios / rejected_counts
        return (ipo_delta - 1 / (2 * beta)) ** 2
    clean = -(1 - smoothing) * F.logsigmoid(beta * delta)
    flipped = -smoothing * F.logsigmoid(-beta * delta)
    return (clean - flipped) / (1 - 2 * smoothing)


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -ln 2."""
    return torch.where(
        x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x))
    )


# ----------------------------------------------------------------------------- units


class PairMean(Mean):
    """torcheval's weighted mean, without its warning that no update was made when the mean is
    exactly 0 (as every reward is at the first step)."""

    weighted_sum: Tensor
    weights: Tensor

    @torch.inference_mode()
    def compute(self) -> Tensor:
        if not self.weights:
            return torch.tensor(0.0, dtype=torch.float64)
        return self.weighted_sum / self.weights


def register_pair_metrics(bag: MetricBag, names: tuple[str, ...], *, persistent: bool) -> None:
    for name in names:
        bag.register_metric(name, PairMean(), persistent=persistent)


def record_pairs(bag: MetricBag, output: PairOutput) -> None:
    """Each metric the bag has, as the mean over the batch's pairs weighted by their number."""
    num_pairs = output.losses.numel()
    values = {
        "loss": output.losses,
        "rewards/chosen": output.chosen_rewards,
        "rewards/rejected": output.rejected_rewards,
        "rewards/accuracies": (output.chosen_rewards > output.rejected_rewards).float(),
        "rewards/margins": output.chosen_rewards - output.rejected_rewards,
        "logps/chosen": output.chosen_logps,
        "logps/rejected": output.rejected_logps,
        **output.extra,
    }
    for name, value in values.items():
        if name in bag.metrics:
            getattr(bag, name).update(value.detach().float().mean(), weight=num_pairs)


class PreferenceTrainUnit(TrainUnit[PairBatch]):
    """The shared step of the preference units: a forward of the policy over the chosen and
    rejected rows, :meth:`pair_losses`, and the metrics. Returns the losses summed over the
    pairs with the number of pairs."""

    extra_metrics: tuple[str, ...] = ()

    def __init__(self, model: nn.Module, options: PreferenceOptions) -> None:
        super().__init__(model)
        options.validate()
        self.options = options
        # The Trainer publishes the step's loss itself.
        register_pair_metrics(
            self.metric_bag, (*PAIR_METRICS, *self.extra_metrics), persistent=False
        )
        # The readers' counts of skipped records and of pairs too long to keep.
        self.metric_bag.register_metric("num_bad_lines", Max(), persistent=False)
        self.metric_bag.register_metric("num_dropped_pairs", Max(), persistent=False)

    @abstractmethod
    def pair_losses(self, batch: PairBatch, logits: Tensor) -> PairOutput:
        """The losses and metrics of each pair, from the policy's logits of the batch."""

    def forward(self, batch: PairBatch) -> PairOutput:
        return self.pair_losses(batch, logits_of(self.model, batch))

    def __call__(self, batch: PairBatch) -> tuple[Tensor, int | None]:
        self.metric_bag.num_bad_lines.update(torch.tensor(batch.num_bad_lines))
        self.metric_bag.num_dropped_pairs.update(torch.tensor(batch.num_dropped))
        output = self.forward(batch)
        record_pairs(self.metric_bag, output)
        return output.losses.sum(), batch.num_pairs


class DpoTrainUnit(PreferenceTrainUnit):
    """DPO: the policy's log-probability ratios to a frozen reference, chosen over rejected."""

    def __init__(self, model: nn.Module, reference: Reference, options: PreferenceOptions) -> None:
        super().__init__(model, options)
        self.reference = reference

    def pair_losses(self, batch: PairBatch, logits: Tensor) -> PairOutput:
        policy_logps = sequence_logps(logits, batch.target_ids)
        logratios = policy_logps.sums - self.reference.logps(batch)
        chosen_logratios, rejected_logratios = logratios.chunk(2)
        losses = dpo_losses(chosen_logratios, rejected_logratios, policy_logps.counts, self.options)
        beta = self.options.beta
        chosen_logps, rejected_logps = policy_logps.sums.detach().chunk(2)
        return PairOutput(
            losses,
            beta * chosen_logratios.detach(),
            beta * rejected_logratios.detach(),
            chosen_logps,
            rejected_logps,
            {},
        )


class SimpoTrainUnit(PreferenceTrainUnit):
    """SimPO: the length-normalized log-probabilities, chosen over rejected by a margin gamma;
    no reference."""

    def pair_losses(self, batch: PairBatch, logits: Tensor) -> PairOutput:
        policy_logps = sequence_logps(logits, batch.target_ids)
        beta, gamma, smoothing = (
            self.options.beta,
            self.options.simpo_gamma,
            self.options.label_smoothing,
        )
        chosen, rejected = policy_logps.means().chunk(2)
        logits = chosen - rejected - gamma / beta
        losses = (
            -F.logsigmoid(beta * logits) * (1 - smoothing)
            - F.logsigmoid(-beta * logits) * smoothing
        )
        chosen, rejected = chosen.detach(), rejected.detach()
        return PairOutput(losses, beta * chosen, beta * rejected, chosen, rejected, {})


class OrpoTrainUnit(PreferenceTrainUnit):
    """ORPO: the chosen sequence's NLL minus lambda times the log sigmoid of the log odds ratio
    of chosen over rejected (from each completion's mean token log-probability); no reference.

    The NLL is TRL's: over the chosen sequence's prompt and completion tokens, here the mean of
    each pair's (TRL takes the mean over the batch's tokens, which is no sum over pairs)."""

    extra_metrics = ("nll_loss", "log_odds_ratio", "log_odds_chosen")

    def pair_losses(self, batch: PairBatch, logits: Tensor) -> PairOutput:
        beta, n = self.options.beta, batch.num_pairs
        chosen, rejected = sequence_logps(logits, batch.target_ids).means().chunk(2)
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        nll = -sequence_logps(logits[:n], whole_sequence_targets(batch)[:n]).means()
        losses = nll - beta * ratio
        chosen, rejected = chosen.detach(), rejected.detach()
        extra = {"nll_loss": nll, "log_odds_ratio": ratio, "log_odds_chosen": log_odds}
        return PairOutput(losses, beta * chosen, beta * rejected, chosen, rejected, extra)


class CpoTrainUnit(PreferenceTrainUnit):
    """CPO: -log sigmoid(beta times the log-probability of chosen minus that of rejected), plus
    cpo_alpha times the chosen completion's NLL (the mean over its tokens); no reference."""

    extra_metrics = ("nll_loss",)

    def pair_losses(self, batch: PairBatch, logits: Tensor) -> PairOutput:
        beta, smoothing = self.options.beta, self.options.label_smoothing
        logps = sequence_logps(logits, batch.target_ids)
        chosen, rejected = logps.sums.chunk(2)
        margin = beta * (chosen - rejected)
        losses = -F.logsigmoid(margin) * (1 - smoothing) - F.logsigmoid(-margin) * smoothing
        nll = -logps.means().chunk(2)[0]
        losses = losses + self.options.cpo_alpha * nll
        chosen, rejected = chosen.detach(), rejected.detach()
        extra = {"nll_loss": nll}
        return PairOutput(losses, beta * chosen, beta * rejected, chosen, rejected, extra)


class PreferenceEvalUnit(EvalUnit[PairBatch]):
    """The train unit's losses and metrics on valid pairs, without gradient."""

    def __init__(self, train_unit: PreferenceTrainUnit) -> None:
        super().__init__(train_unit.model)
        self._train_unit = train_unit
        names = ("loss", *PAIR_METRICS, *train_unit.extra_metrics)
        register_pair_metrics(self.metric_bag, names, persistent=True)

    def __call__(self, batch: PairBatch) -> None:
        with torch.no_grad():
            record_pairs(self.metric_bag, self._train_unit.forward(batch))


def preference_unit(
    task: str,
    model: nn.Module,
    options: PreferenceOptions,
    reference: Reference | None,
) -> PreferenceTrainUnit:
    """The train unit of ``task``; DPO needs ``reference``, the others take none."""
    if task == "dpo":
        if reference is None:
            raise ValueError("task=dpo needs a reference model.")
        return DpoTrainUnit(model, reference, options)
    if reference is not None:
        raise ValueError(f"task={task} uses no reference model, but one was given.")
    if task == "simpo":
        return SimpoTrainUnit(model, options)
    if task == "orpo":
        return OrpoTrainUnit(model, options)
    if task == "cpo":
        return CpoTrainUnit(model, options)
    raise ValueError(f"task must be one of {', '.join(PREFERENCE_TASKS)}, but is {task} instead.")
