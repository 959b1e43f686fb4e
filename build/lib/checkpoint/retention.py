"""Which checkpoints to keep: keep-last and keep-best, for full checkpoints and for models, and
the permanent snapshots. Only healthy checkpoints count as last or best; an unhealthy one is
never deleted by retention (see :mod:`checkpoint.health`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from trainkit_utils.arguments import check_positive
from trainkit_utils.scores import score_key


@dataclass(frozen=True)
class CheckpointInfo:
    step_nr: int
    score: float | None
    kind: Literal["full", "model"]
    size_bytes: int
    healthy: bool = True
    """False once marked unhealthy: saved after a loss spike began and before it was found."""
    permanent: bool = False
    """A snapshot that retention never deletes (see ``keep_checkpoint_every_n_steps``)."""


@dataclass(frozen=True)
class RetentionPolicy:
    """What survives a save. ``None`` means "no limit of that kind".

    Full checkpoints kept = the union of the last ``keep_last_n_checkpoints``,
    the best ``keep_best_n_checkpoints`` by score, and the newest. Of the rest, those among the last
    ``keep_last_n_models`` or best ``keep_best_n_models`` are pruned to their model (fairseq2's
    meaning); the others are deleted. With no limit at all, everything is kept.

    Only healthy checkpoints count as the last or the best, and the newest healthy one is always
    kept, however many unhealthy ones are newer. Unhealthy checkpoints are kept for inspection,
    and so are the permanent snapshots: those marked permanent, and those of a step that is a
    multiple of ``keep_checkpoint_every_n_steps``.
    """

    keep_last_n_checkpoints: int | None = None
    keep_best_n_checkpoints: int | None = None
    keep_last_n_models: int | None = None
    keep_best_n_models: int | None = None
    keep_checkpoint_every_n_steps: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "keep_last_n_checkpoints",
            "keep_best_n_checkpoints",
            "keep_last_n_models",
            "keep_best_n_models",
            "keep_checkpoint_every_n_steps",
        ):
            check_positive(name, getattr(self, name))
        _check_not_below(
            "keep_last_n_models",
            self.keep_last_n_models,
            "keep_last_n_checkpoints",
            self.keep_last_n_checkpoints,
        )
        _check_not_below(
            "keep_best_n_models",
            self.keep_best_n_models,
            "keep_best_n_checkpoints",
            self.keep_best_n_checkpoints,
        )

    @property
    def limits_checkpoints(self) -> bool:
        return self.keep_last_n_checkpoints is not None or self.keep_best_n_checkpoints is not None

    def is_permanent(self, step_nr: int) -> bool:
        """Whether the checkpoint of ``step_nr`` is a permanent snapshot by this policy."""
        every = self.keep_checkpoint_every_n_steps
        return every is not None and step_nr % every == 0

    @property
    def uses_score(self) -> bool:
        return self.keep_best_n_checkpoints is not None or self.keep_best_n_models is not None


@dataclass(frozen=True)
class RetentionPlan:
    keep: frozenset[int]
    """Every checkpoint that survives, whole or pruned to its model."""
    prune_to_model: frozenset[int] = field(default_factory=frozenset)
    delete: frozenset[int] = field(default_factory=frozenset)


def plan_retention(
    infos: Sequence[CheckpointInfo], policy: RetentionPolicy, *, lower_better: bool = True
) -> RetentionPlan:
    """Decide for each committed checkpoint: keep it, prune it to its model, or delete it.

    ``lower_better`` orients the scores the keep-best limits rank by.
    """
    steps = sorted(info.step_nr for info in infos)
    if not steps or not policy.limits_checkpoints:
        return RetentionPlan(keep=frozenset(steps))

    healthy = [i for i in infos if i.healthy]
    full = [i for i in healthy if i.kind == "full"]
    # Kept as they are: the newest healthy checkpoint, and what retention never deletes.
    keep_as_is = {i.step_nr for i in infos if _never_deleted(i, policy)}
    keep_as_is |= {max(i.step_nr for i in healthy)} if healthy else set()
    keep_full = _last(full, policy.keep_last_n_checkpoints)
    keep_full |= _best(full, policy.keep_best_n_checkpoints, lower_better)

    keep_model = _last(healthy, policy.keep_last_n_models)
    keep_model |= _best(healthy, policy.keep_best_n_models, lower_better)

    kinds = {i.step_nr: i.kind for i in infos}
    prune = {s for s in keep_model - keep_full - keep_as_is if kinds[s] == "full"}
    keep = keep_as_is | keep_full | keep_model
    return RetentionPlan(
        keep=frozenset(keep),
        prune_to_model=frozenset(prune),
        delete=frozenset(set(steps) - keep),
    )


def best_checkpoint(
    infos: Sequence[CheckpointInfo], *, lower_better: bool
) -> CheckpointInfo | None:
    """The healthy checkpoint with the best score (the newest among equals), or None if no healthy
    one is scored."""
    best = _ranked(infos, lower_better)
    return best[0] if best else None


def _never_deleted(info: CheckpointInfo, policy: RetentionPolicy) -> bool:
    return not info.healthy or info.permanent or policy.is_permanent(info.step_nr)


def _last(infos: Sequence[CheckpointInfo], n: int | None) -> set[int]:
    if n is None:
        return set()
    return {i.step_nr for i in sorted(infos, key=lambda i: i.step_nr)[-n:]}


def _best(infos: Sequence[CheckpointInfo], n: int | None, lower_better: bool) -> set[int]:
    if n is None:
        return set()
    return {i.step_nr for i in _ranked(infos, lower_better)[:n]}


def _ranked(infos: Sequence[CheckpointInfo], lower_better: bool) -> list[CheckpointInfo]:
    """The scored healthy checkpoints, best first; ties go to the newer checkpoint."""

    def key(info: CheckpointInfo) -> tuple[float, int]:
        assert info.score is not None
        return (score_key(info.score, lower_better=lower_better), -info.step_nr)

    return sorted((i for i in infos if i.score is not None and i.healthy), key=key)


def _check_not_below(name: str, value: int | None, other: str, other_value: int | None) -> None:
    if value is not None and other_value is not None and value < other_value:
        raise ValueError(
            f"{name} must be at least {other} ({other_value}), since every kept checkpoint keeps "
            f"its model, but is {value} instead."
        )
