"""GRPO: online reinforcement learning with the user's reward functions, as TRL 1.16's
``GRPOTrainer`` computes it.

Each micro-batch of prompts (:class:`PromptBatch`) becomes ``num_generations`` completions a
prompt (a group, on one rank), drawn by a :class:`~units.generation.CompletionGenerator`. The
reward functions score them; each completion's advantage is its reward minus its group's mean,
divided by the group's (or the batch's) std plus 1e-4. The loss is PPO's clipped objective per
completion token, plus ``beta`` times the k3 KL estimate against a frozen reference, reduced as
``loss_type`` says. The unit returns the loss SUMMED with a count chosen per loss type, so the
Trainer's normalization (sum over the step / total count, across accumulation and DP ranks)
gives TRL's update exactly (see :func:`reduce_token_losses` and docs/rl.md).

With ``num_iterations > 1`` the completions of one step are reused for the next
``num_iterations - 1`` steps, with the log-probabilities the policy gave them when they were
drawn (the "old" ones) in the importance ratio; the prompts read at those steps are not used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torcheval.metrics import Max, Metric

from gangs import Gang, ReduceOperation
from trainkit_utils.arguments import check_positive
from trainkit_utils.modules import unwrap_model
from units.errors import UserFunctionError
from units.generation import CompletionGenerator
from units.lm import logits_of
from units.preference import PairMean
from units.reference import ModelReference
from units.unit import TrainUnit

GrpoLossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ScaleRewards = Literal["group", "batch", "none"]

GRPO_METRICS = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "completions/mean_length",
    "completions/clipped_ratio",
)


@dataclass
class GrpoOptions:
    """GRPO's options, with TRL's ``GRPOConfig`` names, meanings and defaults."""

    reward_functions: list[str] = field(default_factory=list)
    """Reward functions by import path, "package.module:function"."""
    reward_weights: list[float] | None = None
    """One weight per reward function (default: 1 each); the reward is the weighted sum."""
    num_generations: int = 8
    """Completions drawn for each prompt: a group, whose mean reward is its baseline."""
    temperature: float = 1.0
    """Sampling temperature; the log-probabilities of the loss use the same."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of tokens with this much probability."""
    max_completion_length: int = 256
    """Most tokens of a completion."""
    beta: float = 0.0
    """Weight of the KL term against the frozen reference (0: no reference is built)."""
    epsilon: float = 0.2
    """Clip the probability ratio below at 1 - epsilon (and above at 1 + epsilon_high)."""
    epsilon_high: float | None = None
    """The upper clip (default: epsilon); DAPO's clip-higher uses 0.28."""
    num_iterations: int = 1
    """Optimizer steps taken on each batch of completions (PPO's mu)."""
    loss_type: GrpoLossType = "dapo"
    """How token losses are reduced: grpo, bnpo, dr_grpo or dapo (docs/rl.md)."""
    scale_rewards: ScaleRewards = "group"
    """Divide advantages by the group's std, the batch's, or nothing (Dr. GRPO)."""

    @property
    def upper_epsilon(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def check(self) -> None:
        """Refuse options that cannot work, in one line each."""
        if not self.reward_functions:
            raise ValueError(
                'grpo.reward_functions is empty. Name at least one, e.g. ["mypkg.rewards:exact"].'
            )
        weights = self.reward_weights
        if weights is not None and len(weights) != len(self.reward_functions):
            raise ValueError(
                f"grpo.reward_weights has {len(weights)} weights for "
                f"{len(self.reward_functions)} reward functions; give one each, or none."
            )
        if self.num_generations < 2:
            raise ValueError(
                "grpo.num_generations must be at least 2: a group's mean reward is the baseline, "
                f"but it is {self.num_generations}."
            )
        for name in ("temperature", "max_completion_length", "num_iterations"):
            check_positive(f"grpo.{name}", getattr(self, name))
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"grpo.top_p must be in (0, 1], but is {self.top_p}.")
        if self.beta < 0 or self.epsilon < 0 or self.upper_epsilon < 0:
            raise ValueError("grpo.beta, grpo.epsilon and grpo.epsilon_high must not be negative.")
        if self.loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
            raise ValueError(
                f"grpo.loss_type must be grpo, bnpo, dr_grpo or dapo, but is {self.loss_type}."
            )
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ValueError(
                f"grpo.scale_rewards must be group, batch or none, but is {self.scale_rewards}."
            )


class PromptBatch(Protocol):
    """Prompts of one micro-batch (``runtime.data.text.PromptBatch`` is one): each as the
    record gave it (text or chat messages), its tokens, and the record's other fields, one value
    per prompt, which the reward functions receive."""

    prompts: list[Any]
    prompt_ids: list[list[int]]
    columns: dict[str, list[Any]]


# ----------------------------------------------------------------------------- rewards


class RewardFunctionError(UserFunctionError):
    """A reward function failed or returned the wrong number of scores; one line names it."""


RewardFunction = Callable[..., Sequence[float | None]]


def load_reward_function(path: str) -> RewardFunction:
    """The function ``path`` names, "package.module:function"."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ValueError(
            f'A reward function is named "package.module:function", but {path!r} is not.'
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as ex:
        raise ValueError(f"Reward function {path}: cannot import {module_name} ({ex}).") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"Reward function {path}: {module_name} has no function {attribute}.")
    return function  # type: ignore[no-any-return]


@dataclass
class RewardState:
    """What reward functions get as ``trainer_state``: TRL's ``TrainerState`` fields they read."""

    global_step: int
    max_steps: int | None = None


class RewardFunctions:
    """Named reward functions with their weights, called with TRL's keyword arguments."""

    def __init__(self, paths: Sequence[str], weights: Sequence[float] | None = None) -> None:
        self.names = list(paths)
        self.functions = [load_reward_function(path) for path in paths]
        self.weights = torch.tensor(
            list(weights) if weights is not None else [1.0] * len(paths), dtype=torch.float32
        )

    @classmethod
    def of(cls, named: dict[str, RewardFunction], weights: Sequence[float] | None = None) -> Any:
        """Reward functions given as objects (tests, notebooks): ``{name: function}``."""
        self = cls.__new__(cls)
        self.names, self.functions = list(named), list(named.values())
        self.weights = torch.tensor(
            list(weights) if weights is not None else [1.0] * len(named), dtype=torch.float32
        )
        return self

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        columns: dict[str, list[Any]],
        state: RewardState,
    ) -> Tensor:
        """``[num_completions, num_functions]`` scores; None becomes NaN (not scored)."""
        scores = torch.empty(len(completions), len(self.functions), dtype=torch.float32)
        for i, (name, function) in enumerate(zip(self.names, self.functions, strict=True)):
            try:
                values = function(
                    prompts=prompts,
                    completions=completions,
                    completion_ids=completion_ids,
                    trainer_state=state,
                    log_extra=_ignore,
                    log_metric=_ignore,
                    **columns,
                )
                values = [float("nan") if v is None else float(v) for v in values]
            except Exception as ex:
                message = str(ex).splitlines()[0] if str(ex) else ""
                raise RewardFunctionError(
                    f"The reward function {name} raised {type(ex).__name__}: {message}"
                ) from ex
            if len(values) != len(completions):
                raise RewardFunctionError(
                    f"The reward function {name} returned {len(values)} scores for "
                    f"{len(completions)} completions; it must return one per completion."
                )
            scores[:, i] = torch.tensor(values, dtype=torch.float32)
        return scores


def _ignore(*args: Any, **kwargs: Any) -> None:
    """TRL's ``log_extra`` and ``log_metric`` callbacks: accepted, not recorded."""


# ----------------------------------------------------------------------------- math


class Advantages(NamedTuple):
    rewards: Tensor  # [N] weighted sum, NaN where no function scored
    advantages: Tensor  # [N]
    is_std_zero: Tensor  # [N] bool


def _nanstd(values: Tensor, dim: int | None = None) -> Tensor:
    """TRL's ``nanstd``: Bessel-corrected, NaN left out."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    count = (~values.isnan()).sum(dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1)
    return variance.sqrt() if dim is None else variance.sqrt().squeeze(dim)


def advantages_of(
    scores: Tensor,
    weights: Tensor,
    num_generations: int,
    scale_rewards: ScaleRewards,
    batch_std: Callable[[Tensor], Tensor] | None = None,
) -> Advantages:
    """TRL's advantages (``sum_then_normalize``): reward minus its group's mean, over the group's
    std (``group``), the batch's (``batch``; ``batch_std`` makes it over every DP rank) or 1
    (``none``), plus 1e-4. An unscored completion's advantage is 0."""
    unscored = scores.isnan().all(dim=1)
    rewards = (scores * weights.to(scores.device)).nansum(dim=1)
    rewards[unscored] = float("nan")
    groups = rewards.view(-1, num_generations)
    means = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = (batch_std or _nanstd)(rewards).expand_as(rewards)
    else:
        std = _nanstd(groups, dim=1).repeat_interleave(num_generations)
    advantages = rewards - means
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    is_std_zero = torch.isclose(std, torch.zeros_like(std))
    return Advantages(rewards, torch.nan_to_num(advantages, nan=0.0), is_std_zero)


def token_logps(
    logits: Tensor, completion_ids: Tensor, temperature: float, *, entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Each completion token's log-probability under ``logits / temperature`` (the logits that
    predict the completion, ``[N, C, V]``), in float32; with ``entropy``, each position's."""
    log_probs = F.log_softmax(logits.float() / temperature, dim=-1)
    logps = log_probs.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return logps, None
    with torch.no_grad():
        return logps, -(log_probs.exp() * log_probs).sum(-1)


def clipped_token_losses(
    logps: Tensor, old_logps: Tensor, advantages: Tensor, epsilon: float, epsilon_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate per token, negated, and the ratio ``exp(logps - old_logps)``."""
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    advantages = advantages.unsqueeze(1)
    return -torch.min(ratio * advantages, clipped * advantages), ratio


def kl_per_token(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """The k3 estimate of KL(policy || reference): ``exp(ref - logp) - (ref - logp) - 1``."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def reduce_token_losses(
    token_losses: Tensor, mask: Tensor, loss_type: GrpoLossType, max_completion_length: int
) -> tuple[Tensor, int]:
    """The micro-batch's loss as a SUM with its count, such that the Trainer's sum over the
    step divided by the total count over accumulation and DP is TRL's update exactly:

    - ``grpo``: the sum of each sequence's mean token loss, counted in sequences (TRL's mean
      over sequences, then over micro-batches and ranks, which all hold as many sequences);
    - ``bnpo``: the micro-batch's mean over its tokens, counted 1 (TRL's per-micro-batch mean,
      averaged over micro-batches and ranks);
    - ``dr_grpo``: the token sum, counted sequences x max_completion_length;
    - ``dapo``: the token sum, counted in tokens: the all-reduced count is TRL's global number
      of tokens (its ``num_items_in_batch``).
    """
    masked = token_losses * mask
    num_sequences = mask.size(0)
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum(), num_sequences
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1), 1
    if loss_type == "dr_grpo":
        return masked.sum(), num_sequences * max_completion_length
    return masked.sum(), int(mask.sum().item())


# ----------------------------------------------------------------------------- metrics


class SampleStd(Metric[Tensor]):
    """The Bessel-corrected std of every value recorded (NaN left out), merged over ranks by
    summing counts, sums and sums of squares."""

    summed_states = ("count", "total", "squares")
    count: Tensor
    total: Tensor
    squares: Tensor

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__(device=device)
        for name in self.summed_states:
            self._add_state(name, torch.tensor(0.0, dtype=torch.float64, device=self.device))

    @torch.inference_mode()
    def update(self, values: Tensor) -> SampleStd:
        values = values.detach().double().flatten()
        values = values[~values.isnan()].to(self.device)
        self.count += values.numel()
        self.total += values.sum()
        self.squares += (values**2).sum()
        return self

    @torch.inference_mode()
    def compute(self) -> Tensor:
        if self.count < 2:
            return torch.tensor(float("nan"), dtype=torch.float64)
        variance = (self.squares - self.total**2 / self.count) / (self.count - 1)
        return variance.clamp(min=0).sqrt()

    @torch.inference_mode()
    def merge_state(self, metrics: Any) -> SampleStd:
        for metric in metrics:
            for name in self.summed_states:
                setattr(self, name, getattr(self, name) + getattr(metric, name).to(self.device))
        return self


# ----------------------------------------------------------------------------- the unit


@dataclass
class Rollout:
    """One micro-batch's completions, ready for the loss: prompts left-padded and completions
    right-padded as TRL lays them out, advantages, and the old and reference log-probs."""

    input_ids: Tensor  # [N, P + C]
    attention_mask: Tensor  # [N, P + C]
    completion_ids: Tensor  # [N, C]
    completion_mask: Tensor  # [N, C], float
    advantages: Tensor  # [N]
    old_logps: Tensor | None
    ref_logps: Tensor | None
    metrics: dict[str, Tensor]  # per completion: reward, is_std_zero, length, clipped


class _Inputs(NamedTuple):
    input_ids: Tensor
    attention_mask: Tensor


class GrpoTrainUnit(TrainUnit[PromptBatch]):
    """GRPO's step: roll out (or reuse) completions, score them, and return the clipped
    policy-gradient loss (plus ``beta`` times the KL to ``reference``) as a sum with its count
    (:func:`reduce_token_losses`). ``dp_gang``: where ``scale_rewards=batch`` takes its std."""

    def __init__(
        self,
        model: nn.Module,
        options: GrpoOptions,
        *,
        generator: CompletionGenerator,
        rewards: RewardFunctions,
        decode: Callable[[list[int]], str],
        eos_ids: Sequence[int],
        pad_id: int,
        reference: ModelReference | None = None,
        dp_gang: Gang | None = None,
        max_num_steps: int | None = None,
    ) -> None:
        super().__init__(model)
        options.check()
        if (options.beta > 0) != (reference is not None):
            raise ValueError("GRPO takes a reference model exactly when grpo.beta > 0.")
        self.options, self.generator, self.rewards = options, generator, rewards
        self.reference, self.dp_gang = reference, dp_gang
        self._decode, self._eos_ids, self._pad_id = decode, set(eos_ids), pad_id
        self._max_num_steps = max_num_steps
        self._step_nr, self._micro_nr = 1, 0
        self._buffer: list[Rollout] = []
        bag = self.metric_bag
        for name in GRPO_METRICS:
            if name == "kl" and options.beta == 0:
                continue
            bag.register_metric(name, SampleStd() if name == "reward_std" else PairMean(), False)
        for name in rewards.names:
            bag.register_metric(_reward_metric(name), PairMean(), persistent=False)
        bag.register_metric("num_bad_lines", Max(), persistent=False)

    def set_step_nr(self, step_nr: int) -> None:
        self._step_nr, self._micro_nr = step_nr, 0

    def __call__(self, batch: PromptBatch) -> tuple[Tensor, int | None]:
        generates = (self._step_nr - 1) % self.options.num_iterations == 0
        if generates:
            rollout = self.rollout(batch)
            if self._micro_nr == 0:
                self._buffer = []
            if self.options.num_iterations > 1:
                self._buffer.append(rollout)
        else:
            rollout = self._buffer[self._micro_nr]
        self._micro_nr += 1
        self.metric_bag.num_bad_lines.update(torch.tensor(getattr(batch, "num_bad_lines", 0)))
        return self.loss(rollout)

    # -------------------------------------------------------------------------- rollouts

    def rollout(self, batch: PromptBatch) -> Rollout:
        """Generate, score and lay out the completions of ``batch``'s prompts."""
        g = self.options.num_generations
        completions_ids = self.generator.generate(
            batch.prompt_ids, num_generations=g, step_nr=self._step_nr
        )
        prompt_ids = [ids for ids in batch.prompt_ids for _ in range(g)]
        if len(completions_ids) != len(prompt_ids):
            raise RuntimeError(
                f"The generator returned {len(completions_ids)} completions for "
                f"{len(batch.prompt_ids)} prompts x {g} generations."
            )
        prompts = [p for p in batch.prompts for _ in range(g)]
        texts = [self._decode(ids) for ids in completions_ids]
        completions: list[Any] = [
            [{"role": "assistant", "content": text}] if isinstance(p, list) else text
            for p, text in zip(prompts, texts, strict=True)
        ]
        columns = {k: [v for v in values for _ in range(g)] for k, values in batch.columns.items()}
        state = RewardState(global_step=self._step_nr - 1, max_steps=self._max_num_steps)
        scores = self.rewards(prompts, completions, completions_ids, columns, state)
        batch_std = self._batch_std if self.dp_gang is not None and self.dp_gang.size > 1 else None
        adv = advantages_of(
            scores, self.rewards.weights, g, self.options.scale_rewards, batch_std=batch_std
        )
        device = next(iter(self.model.parameters())).device
        input_ids, attention_mask, completion_ids, completion_mask = self._layout(
            prompt_ids, completions_ids, device
        )
        inputs = _Inputs(input_ids, attention_mask)
        c = completion_ids.size(1)
        old_logps = ref_logps = None
        with torch.no_grad():
            if self.options.num_iterations > 1:
                logits = logits_of(unwrap_model(self.model), inputs)[:, -c - 1 : -1]
                old_logps = token_logps(logits, completion_ids, self.options.temperature)[0]
            if self.reference is not None:
                logits = self.reference.logits(inputs)[:, -c - 1 : -1]
                ref_logps = token_logps(logits, completion_ids, self.options.temperature)[0]
        metrics = self._rollout_metrics(completions_ids, scores, adv)
        return Rollout(
            input_ids,
            attention_mask,
            completion_ids,
            completion_mask,
            adv.advantages.to(device),
            old_logps,
            ref_logps,
            metrics,
        )

    def _rollout_metrics(
        self, completions_ids: list[list[int]], scores: Tensor, adv: Advantages
    ) -> dict[str, Tensor]:
        """Per completion: the values of TRL's reward and completion metrics."""
        lengths = torch.tensor([len(ids) for ids in completions_ids], dtype=torch.float32)
        ends = self._eos_ids | {self._pad_id}
        clipped = torch.tensor([float(not ids or ids[-1] not in ends) for ids in completions_ids])
        return {
            "reward": adv.rewards,
            "frac_reward_zero_std": adv.is_std_zero.float(),
            "completions/mean_length": lengths,
            "completions/clipped_ratio": clipped,
            **{_reward_metric(name): scores[:, i] for i, name in enumerate(self.rewards.names)},
        }

    def _batch_std(self, rewards: Tensor) -> Tensor:
        """The std of every rank's rewards (this micro-batch's), from summed moments."""
        assert self.dp_gang is not None
        valid = rewards[~rewards.isnan()].double()
        moments = torch.stack([valid.new_tensor(valid.numel()), valid.sum(), (valid**2).sum()])
        moments = moments.to(self.dp_gang.device)
        self.dp_gang.all_reduce(moments, ReduceOperation.SUM)
        n, total, squares = moments.cpu().unbind()
        return ((squares - total**2 / n) / (n - 1)).clamp(min=0).sqrt().float()

    def _layout(
        self, prompt_ids: list[list[int]], completion_ids: list[list[int]], device: torch.device
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """TRL's layout: prompts padded on the left, completions on the right."""
        n, p = len(prompt_ids), max(len(ids) for ids in prompt_ids)
        c = max(1, max(len(ids) for ids in completion_ids))
        ids = torch.full((n, p + c), self._pad_id, dtype=torch.long)
        mask = torch.zeros((n, p + c), dtype=torch.long)
        for row, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
            ids[row, p - len(prompt) : p] = torch.tensor(prompt, dtype=torch.long)
            mask[row, p - len(prompt) : p] = 1
            ids[row, p : p + len(completion)] = torch.tensor(completion, dtype=torch.long)
            mask[row, p : p + len(completion)] = 1
        ids, mask = ids.to(device), mask.to(device)
        return ids, mask, ids[:, p:], mask[:, p:].float()

    # -------------------------------------------------------------------------- the loss

    def loss(self, rollout: Rollout) -> tuple[Tensor, int]:
        options = self.options
        c = rollout.completion_ids.size(1)
        inputs = _Inputs(rollout.input_ids, rollout.attention_mask)
        logits = logits_of(self.model, inputs)[:, -c - 1 : -1]
        logps, entropy = token_logps(
            logits, rollout.completion_ids, options.temperature, entropy=True
        )
        old_logps = rollout.old_logps if rollout.old_logps is not None else logps.detach()
        losses, ratio = clipped_token_losses(
            logps, old_logps, rollout.advantages, options.epsilon, options.upper_epsilon
        )
        mask = rollout.completion_mask
        kl = None
        if rollout.ref_logps is not None:
            # TRL 1.16's default use_bias_correction_kl: times the importance ratio, which
            # makes the KL gradient the unbiased reverse-KL one (DeepSeek-V3.2).
            kl = kl_per_token(logps, rollout.ref_logps) * ratio
            losses = losses + options.beta * kl
        loss, count = reduce_token_losses(
            losses, mask, options.loss_type, options.max_completion_length
        )
        self._record(rollout, ratio.detach(), entropy, kl)
        return loss, count

    def _record(
        self, rollout: Rollout, ratio: Tensor, entropy: Tensor | None, kl: Tensor | None
    ) -> None:
        bag, mask = self.metric_bag, rollout.completion_mask
        num_tokens = mask.sum()

        def token_mean(name: str, values: Tensor) -> None:
            if name in bag.metrics:
                mean = (values.detach().float() * mask).sum() / num_tokens.clamp(min=1)
                getattr(bag, name).update(mean.cpu(), weight=num_tokens.cpu())

        for name, values in rollout.metrics.items():
            finite = values[~values.isnan()]
            if finite.numel():
                getattr(bag, name).update(finite.mean(), weight=finite.numel())
        bag.reward_std.update(rollout.metrics["reward"])
        advantages = rollout.advantages.unsqueeze(1)
        low = (ratio < 1 - self.options.epsilon) & (advantages < 0)
        high = (ratio > 1 + self.options.upper_epsilon) & (advantages > 0)
        token_mean("clip_ratio/low_mean", low.float())
        token_mean("clip_ratio/high_mean", high.float())
        token_mean("clip_ratio/region_mean", (low | high).float())
        if entropy is not None:
            token_mean("entropy", entropy)
        if kl is not None:
            token_mean("kl", kl)

    # -------------------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The completions kept for the next steps (``num_iterations > 1``), for a resume."""
        return {"step_nr": self._step_nr, "buffer": [vars(r).copy() for r in self._buffer]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        device = next(iter(self.model.parameters())).device

        def placed(value: Any) -> Any:
            return value.to(device) if isinstance(value, Tensor) else value

        self._buffer = [
            Rollout(**{name: placed(value) for name, value in saved.items()})
            for saved in state.get("buffer", [])
        ]


def _reward_metric(name: str) -> str:
    """``rewards/<function>/mean``, as TRL names it (the function's own name)."""
    short = name.rpartition(":")[2].rpartition(".")[2]
    return f"rewards/{short}/mean"
