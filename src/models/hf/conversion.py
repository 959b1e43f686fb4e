"""Hugging Face checkpoint keys <-> a ``transformers`` model's keys, as ``from_pretrained`` and
``save_pretrained`` convert them.

``transformers`` 5 keeps the experts of a mixture-of-experts layer as stacked 3D parameters
(``mlp.experts.gate_up_proj`` is ``[experts, 2 * intermediate, hidden]``), while the files on the
Hub, and those ``save_pretrained`` writes, hold one tensor per expert and projection
(``mlp.experts.3.gate_proj.weight``). ``from_pretrained`` merges them with the family's weight
conversions (``transformers.conversion_mapping``); ``save_pretrained`` splits them again.

This module applies those very conversion objects, so that a key is renamed, merged and split
exactly as ``transformers`` does it, with the same ordering of the experts. Loading goes through
:class:`ConvertedCheckpoint`, a read-only view of the checkpoint under the model's names that
reads and converts one target tensor at a time (a rank holds one layer's experts at most);
:func:`checkpoint_state` is the reverse, for export. A model that is not a ``transformers``
model, or whose family needs no conversion, sees its checkpoint unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, final

from torch import Tensor
from torch.nn import Module


def weight_conversions(model: Module) -> list[Any]:
    """The ``transformers`` weight transforms ``from_pretrained`` applies to ``model`` (an
    unwrapped model); empty for any other model, or a family that loads its keys as they are.
    A pipeline stage's part of such a model (:class:`models.pipeline.HFDecoderStage`) keeps
    the whole model's as ``hf_weight_conversions``: its keys are the whole model's."""
    kept = getattr(model, "hf_weight_conversions", None)
    if kept is not None:
        return list(kept)
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    conversions: list[Any] = get_model_conversion_mapping(model)
    return conversions


class ConversionError(ValueError):
    """The checkpoint's tensors cannot be converted into the model's (an expert missing, a
    shape that does not fit)."""


@dataclass
class _Target:
    template: Any
    """The converter (or renaming) that produces this key, deep-copied for each use."""
    sources: list[tuple[str, str]] = field(default_factory=list)
    """(source key, the source pattern it matched), in the order transformers collects them."""
    group: str = ""
    """The first target key of a one-to-many converter: its siblings are produced with it."""


@final
class ConvertedCheckpoint(Mapping[str, Tensor]):
    """The tensors of ``source`` (a checkpoint's keys, read lazily) under ``model``'s keys,
    converted as ``from_pretrained`` converts them. A source key that maps to no model key keeps
    its own name, so that the caller reports it as unexpected."""

    def __init__(
        self, source: Mapping[str, Tensor], model: Module, model_keys: Mapping[str, object]
    ) -> None:
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        self._source = source
        self._model = model
        conversions = weight_conversions(model)
        renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
        converters = [c for c in conversions if isinstance(c, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        prefix = getattr(model, "base_model_prefix", None)
        known = dict.fromkeys(model_keys, True)
        self._targets: dict[str, _Target] = {}
        for key in sorted(source, key=dot_natural_key):
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, known)
            if renamed not in model_keys and key in model_keys:
                renamed, pattern = key, None
            if pattern is None:
                self._targets[renamed] = _Target(template=None, sources=[(key, key)])
                continue
            converter = by_pattern[pattern]
            first = self._targets.setdefault(renamed, _Target(converter, group=renamed))
            first.sources.append((key, pattern))
            for sibling in converter.target_patterns[1:]:
                name = renamed.replace(converter.target_patterns[0], sibling)
                self._targets.setdefault(name, _Target(converter, group=renamed))
        self._cached: tuple[str, dict[str, Tensor]] | None = None

    def sources_of(self, key: str) -> list[str]:
        """The checkpoint keys that ``key`` is made of."""
        target = self._targets[key]
        return [source for source, _ in self._targets[target.group or key].sources]

    def __getitem__(self, key: str) -> Tensor:
        target = self._targets[key]
        if target.template is None:
            return self._source[target.sources[0][0]]
        if self._cached is None or self._cached[0] != target.group:
            self._cached = (target.group, self._convert(target.group))
        return self._cached[1][key]

    def _convert(self, group: str) -> dict[str, Tensor]:
        target = self._targets[group]
        converter = copy.deepcopy(target.template)
        for source_key, pattern in target.sources:
            # A callable is read when the converter materializes its inputs (transformers'
            # synchronous loading): one layer's tensors at a time.
            converter.add_tensor(group, source_key, pattern, _reader(self._source, source_key))
        counts = {p: sum(1 for _, q in target.sources if q == p) for _, p in target.sources}
        try:
            if len(set(counts.values())) > 1:
                raise ValueError(f"{counts} tensors by pattern, not as many of each")
            config = getattr(self._model, "config", None)
            converted = converter.convert(group, model=self._model, config=config)
        except (RuntimeError, ValueError) as ex:
            raise ConversionError(
                f"The checkpoint's tensors for '{group}' ({len(target.sources)} of them, from "
                f"{target.sources[0][0]}) cannot be merged as transformers merges them: {ex}. "
                "Check that the checkpoint holds every expert of every layer."
            ) from ex
        return {
            name: value[0] if isinstance(value, list) else value
            for name, value in converted.items()
        }

    def __iter__(self) -> Iterator[str]:
        return iter(self._targets)

    def __len__(self) -> int:
        return len(self._targets)


def _reader(source: Mapping[str, Tensor], key: str) -> Any:
    return lambda: source[key]


def checkpoint_state(model: Module, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state`` (``model``'s keys) under the keys ``save_pretrained`` writes: experts split per
    expert again, names renamed back. Unchanged for a model that needs no conversion."""
    if not weight_conversions(model):
        return dict(state)
    from transformers import PreTrainedModel
    from transformers.core_model_loading import revert_weight_conversion

    assert isinstance(model, PreTrainedModel)  # weight_conversions: only these have any
    reverted: dict[str, Tensor] = revert_weight_conversion(model, dict(state))
    return {key: value.contiguous() for key, value in reverted.items()}
