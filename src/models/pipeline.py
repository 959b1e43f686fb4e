"""Splitting decoder models into pipeline stages, by layers.

A stage is a module of its own that holds the parts of the whole model it computes, under the
whole model's names (``model.layers.5.mlp.up_proj.weight`` stays that): the embeddings on the
first stage, the final norm and the head on the last, its run of decoder layers between, and the
rotary embedding computed wherever layers need it. A rank's *part* is one such module over all of
its stages (two or more with the looped and V-shaped schedules), whose state dict is the whole
model's keys that the rank owns: checkpoints hold the unsplit names, so a run resumes at another
pipeline size with ``reshard_on_resume``.

Nothing is copied: the stages and the part share the whole model's modules, which the rank drops
once it keeps only its part. Build the whole model on the meta device, split it, then
materialize the part (its initialization depends on the names alone, so it equals the whole
model's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, final

from torch import Tensor, nn

from models.hf.conversion import weight_conversions
from models.llama import Llama, LlamaArgs, rotary_and_mask
from models.moe.routing import RouterStatistics
from trainkit_utils.modules import record_split_ties


def split_layers(
    num_layers: int, num_stages: int, split: Sequence[int] | None = None
) -> list[range]:
    """The decoder layers of each of ``num_stages`` stages, in order.

    Balanced by default: every stage gets ``num_layers // num_stages`` layers, and the remainder
    goes one each to the stages before the last (which also computes the head and the loss).
    ``split`` (``pipeline.split``) gives each stage's number of layers instead.
    """
    if split is not None:
        counts = list(split)
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 0:
            raise ValueError(
                f"pipeline.split must give the layers of each of the {num_stages} stages, summing "
                f"to the model's {num_layers} layers, but is {counts}."
            )
    else:
        if num_stages > num_layers:
            raise ValueError(
                f"The pipeline has {num_stages} stages, but the model has only {num_layers} "
                "layers to split among them. Lower gang.pp_size or pipeline.stages_per_rank."
            )
        base, extra = divmod(num_layers, num_stages)
        # extra < num_stages: the last stage never gets one.
        counts = [base + (1 if stage < extra else 0) for stage in range(num_stages)]
    starts = [sum(counts[:stage]) for stage in range(num_stages)]
    return [range(start, start + count) for start, count in zip(starts, counts, strict=True)]


class _Body(nn.Module):
    """The whole model's body (``model``, GPT-2's ``transformer``) as far as a stage holds it
    (the flags of the stage say which of its modules it has)."""

    embed_tokens: nn.Module
    layers: nn.ModuleDict
    norm: nn.Module
    rotary_emb: nn.Module


@dataclass(frozen=True)
class _Names:
    """Where a decoder keeps what its stages split, under its body (``model`` or
    ``transformer``): the token embedding, the absolute position embedding and the dropout after
    the embeddings (GPT-2's; None: none), the list of layers and the final norm."""

    body: str = "model"
    tokens: str = "embed_tokens"
    positions: str | None = None
    dropout: str | None = None
    layers: str = "layers"
    norm: str = "norm"

    @property
    def embeddings(self) -> tuple[str, ...]:
        return tuple(n for n in (self.tokens, self.positions, self.dropout) if n is not None)


_LLAMA_NAMES = _Names()
_GPT2_NAMES = _Names(
    body="transformer", tokens="wte", positions="wpe", dropout="drop", layers="h", norm="ln_f"
)


class _DecoderStage(nn.Module):
    """The modules of a decoder that its stages ``layers`` hold, under the whole model's names
    (``names`` says where they are): the embeddings on the first stage (``first``), the norm and
    the head on the last (``last``)."""

    model: _Body
    """The body, where ``names.body`` is ``model`` (the project's Llama and most Hugging Face
    decoders)."""
    lm_head: nn.Module

    def __init__(
        self,
        model: Any,
        layers: Sequence[int],
        *,
        first: bool,
        last: bool,
        names: _Names = _LLAMA_NAMES,
    ) -> None:
        super().__init__()
        self.first = first
        self.last = last
        whole = getattr(model, names.body)
        body = _Body()
        if first:
            for name in names.embeddings:
                body.add_module(name, getattr(whole, name))
        every_layer = getattr(whole, names.layers)
        body.add_module(names.layers, nn.ModuleDict({str(i): every_layer[i] for i in layers}))
        if last:
            body.add_module(names.norm, getattr(whole, names.norm))
        self.add_module(names.body, body)
        if last:
            self.lm_head = model.lm_head


@final
class LlamaStage(_DecoderStage):
    """The part of a :class:`~models.llama.Llama` that pipeline stages hold: ``forward`` takes the
    input ids on the first stage (``first``), the hidden states elsewhere, and returns the logits
    on the last stage (``last``), the hidden states elsewhere.

    Also a rank's part over several stages (never called then): it holds their union.
    """

    def __init__(self, model: Llama, layers: Sequence[int], *, first: bool, last: bool) -> None:
        super().__init__(model, layers, first=first, last=last)
        self.args: LlamaArgs = model.args

    def forward(
        self, x: Tensor, *, document_ids: Tensor | None = None, positions: Tensor | None = None
    ) -> Tensor:
        if self.first:
            x = self.model.embed_tokens(x)
        cos, sin, mask = rotary_and_mask(self.args, x, document_ids, positions)
        for layer in self.model.layers.values():
            x = layer(x, cos, sin, mask)
        if self.last:
            x = self.lm_head(self.model.norm(x))
        return x

    def init_module(self, name: str, module: nn.Module) -> None:
        """The whole model's initialization (``Llama.init_module``)."""
        Llama.init_module(self, name, module)  # type: ignore[arg-type]

    def flops_per_token(self, seq_len: int) -> float:
        """The whole model's FLOPs per token would need all stages; these are this part's."""
        num_params = sum(p.numel() for p in self.parameters())
        num_layers = len(self.model.layers)
        return 6.0 * num_params + 12.0 * num_layers * self.args.dim * seq_len


def split_model(
    model: nn.Module,
    stage_ids: Sequence[int],
    num_stages: int,
    split: Sequence[int] | None = None,
) -> tuple[list[nn.Module], nn.Module]:
    """The stages ``stage_ids`` (of ``num_stages``) of ``model``, and the rank's part that holds
    them all (see the module docstring). ``split``: each stage's number of layers (None:
    balanced). The project's :class:`~models.llama.Llama` and the Hugging Face decoders of
    :data:`HF_PIPELINE_FAMILIES` split; any other model is refused in one line."""
    if isinstance(model, Llama):
        num_layers = model.args.num_layers
        stage_type: type[LlamaStage] | type[HFDecoderStage] = LlamaStage
    else:
        names = _hf_stage_names(model)
        num_layers = len(model.get_submodule(f"{names.body}.{names.layers}"))  # type: ignore[arg-type]
        stage_type = HFDecoderStage
    return split_by_layers(
        model,
        stage_ids,
        num_stages,
        split,
        num_layers=num_layers,
        make_stage=lambda m, layers, first, last: stage_type(m, layers, first=first, last=last),
    )


StageFactory = Callable[[Any, Sequence[int], bool, bool], nn.Module]
"""``(model, layers, first, last) -> stage``: the module of one stage (or of a rank's part)."""


def split_by_layers(
    model: Any,
    stage_ids: Sequence[int],
    num_stages: int,
    split: Sequence[int] | None,
    *,
    num_layers: int,
    make_stage: StageFactory,
) -> tuple[list[nn.Module], nn.Module]:
    """:func:`split_model` for a model of your own: ``make_stage`` builds the module of the given
    layers (and of the embeddings with ``first``, the head with ``last``) under ``model``'s
    names.

    Tied weights (one parameter several modules hold, such as tied input and output
    embeddings) are found by identity: where the first and the last stage hold one on different
    ranks, each holds a copy, which :class:`~runtime.parallel.pipeline.Pipeline` keeps equal, so
    the part records the whole model's ties (:func:`~trainkit_utils.modules.split_ties`)."""
    layers = split_layers(num_layers, num_stages, split)
    last = num_stages - 1
    stages = [make_stage(model, layers[s], s == 0, s == last) for s in stage_ids]
    if len(stages) == 1:
        part = stages[0]
    else:
        owned = sorted(i for s in stage_ids for i in layers[s])
        part = make_stage(model, owned, 0 in stage_ids, last in stage_ids)
    record_split_ties(part, _ties(model))
    return stages, part


def _ties(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that several of ``model``'s modules hold."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [tie for tie in names.values() if len(tie) > 1]


HF_PIPELINE_FAMILIES: Final = frozenset(
    {
        "llama", "mistral", "qwen2", "qwen3", "gemma2", "gpt2", "phi3", "olmo2",
        "qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3", "gpt_oss",
    }
)  # fmt: skip
"""The ``model_type`` of the Hugging Face decoders that split into :class:`HFDecoderStage`: their
forward is embeddings, layers, norm and head, with the quirks the stages read off the config
(sliding windows, final logit soft-capping, absolute positions). A family outside it may do more
between its layers (scale the embeddings or logits by a config factor, mix per-layer rotary
tables), which the stages would silently leave out: it is refused."""

_NAMES_BY_FAMILY: Final = {"gpt2": _GPT2_NAMES}
"""Families whose modules are not under ``model.embed_tokens``, ``model.layers``, ``model.norm``."""


def hf_pipeline_refusal(model_type: object, model: str) -> str | None:
    """The one-line refusal of a Hugging Face decoder of ``model_type`` (``model``: how to name
    it to the user) that does not split into pipeline stages; None where it splits."""
    if model_type in HF_PIPELINE_FAMILIES:
        return None
    return (
        f"{model} (model_type {model_type!r}) does not split into pipeline stages: the "
        "project's Llama (model.name) and the Hugging Face families "
        f"{', '.join(sorted(HF_PIPELINE_FAMILIES))} do, whose forward the stages reproduce. "
        "Use gang.pp_size=1."
    )


def _hf_stage_names(model: nn.Module) -> _Names:
    """Where the Hugging Face decoder ``model`` keeps what its stages split, or the one-line
    refusal (a ``ValueError``) of a model that does not split."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    refusal = hf_pipeline_refusal(model_type, type(model).__name__)
    if refusal is not None:
        raise ValueError(refusal)
    return _NAMES_BY_FAMILY.get(str(model_type), _LLAMA_NAMES)


def _attention_kinds(config: Any, num_layers: int) -> list[str]:
    """Each layer's attention, as the model's own forward picks its mask: ``layer_types`` where
    the config has them (Gemma 2's alternating sliding window, Qwen2's and Qwen3's), else a
    sliding window on every layer where the config sets one (Mistral, Phi-3), else causal."""
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        return list(kinds)
    sliding = getattr(config, "sliding_window", None) is not None
    return ["sliding_attention" if sliding else "full_attention"] * num_layers


@final
class HFDecoderStage(_DecoderStage):
    """The part of a Hugging Face decoder (:data:`HF_PIPELINE_FAMILIES`) that pipeline stages
    hold, as :class:`LlamaStage` for the project's model. Each stage builds the masks of its
    layers with ``transformers``' own mask functions for the config's attention (causal, or a
    sliding window), without padding: packed text (``task=pretrain``) or right-padded examples
    whose padding is never a target (``task=sft``). The rotary embedding (no parameters) is on
    every stage; the last applies the config's final logit soft-capping (Gemma 2). Mixtures of
    experts split alike; with a load-balancing loss their stages pass their routers' sums on
    (``routers``)."""

    def __init__(self, model: Any, layers: Sequence[int], *, first: bool, last: bool) -> None:
        names = _hf_stage_names(model)
        super().__init__(model, layers, first=first, last=last, names=names)
        self.config = model.config
        self._names = names
        whole = getattr(model, names.body)
        self._rotary = hasattr(whole, "rotary_emb")
        if self._rotary:
            self._body.rotary_emb = whole.rotary_emb
        kinds = _attention_kinds(model.config, len(getattr(whole, names.layers)))
        self._kinds = {str(i): kinds[i] for i in layers}
        self._softcap: float | None = getattr(model.config, "final_logit_softcapping", None)
        self.routers = RouterStatistics.of(model, self._body.get_submodule(names.layers).children())
        """A mixture of experts with a load-balancing loss: the sums its routers pass on."""
        self.hf_weight_conversions = weight_conversions(model)
        """How the files' keys become the model's (a mixture of experts' are merged at load)."""

    @property
    def _body(self) -> _Body:
        return self.get_submodule(self._names.body)  # type: ignore[return-value]

    def forward(self, x: Tensor, router_sums: Tensor | None = None) -> Tensor | tuple[Tensor, ...]:
        """The logits (last stage) or hidden states (others) of ``x``. With :attr:`routers`, the
        stages also pass on the router sums (:mod:`models.moe.routing`), and the last returns
        ``(logits, load-balancing loss)``."""
        import torch

        if self.routers is not None:
            self.routers.begin()
        body, names = self._body, self._names
        position_ids = torch.arange(x.size(1), device=x.device)[None, :]
        if self.first:
            x = self._embed(x, position_ids)
        kwargs: dict[str, Any] = {"position_ids": position_ids}
        if self._rotary:
            kwargs["position_embeddings"] = body.rotary_emb(x, position_ids)
        masks = {kind: self._mask(kind, x) for kind in set(self._kinds.values())}
        for name, layer in body.get_submodule(names.layers).named_children():
            out = layer(x, attention_mask=masks[self._kinds[name]], **kwargs)
            x = out[0] if isinstance(out, tuple) else out
        if self.last:
            x = self.lm_head(body.get_submodule(names.norm)(x))
            if self._softcap is not None:
                x = torch.tanh(x / self._softcap) * self._softcap
        if self.routers is None:
            return x
        router_sums = self.routers.add(router_sums, x)
        return (x, self.routers.loss(router_sums)) if self.last else (x, router_sums)

    def _embed(self, ids: Tensor, position_ids: Tensor) -> Tensor:
        body, names = self._body, self._names
        x: Tensor = body.get_submodule(names.tokens)(ids)
        if names.positions is not None:
            x = x + body.get_submodule(names.positions)(position_ids)
        if names.dropout is not None:
            x = body.get_submodule(names.dropout)(x)
        return x

    def _mask(self, kind: str, x: Tensor) -> Any:
        """The mask ``transformers`` builds for the whole model's layers of ``kind`` (None where
        its attention is causal by itself, as ``sdpa``'s). Without the position ids: from them
        ``transformers`` would look for packed sequences, reading a flag off the device, where
        the stage's positions are one sequence's anyway."""
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        make = (
            create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
        )
        return make(config=self.config, inputs_embeds=x, attention_mask=None, cache=None)


__all__ = [
    "HF_PIPELINE_FAMILIES",
    "HFDecoderStage",
    "LlamaStage",
    "StageFactory",
    "hf_pipeline_refusal",
    "split_by_layers",
    "split_layers",
    "split_model",
]
