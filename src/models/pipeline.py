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
from typing import Any, final

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
    """The whole model's ``model`` submodule as far as a stage holds it (the flags of the stage
    say which of these it has)."""

    embed_tokens: nn.Module
    layers: nn.ModuleDict
    norm: nn.Module
    rotary_emb: nn.Module


class _DecoderStage(nn.Module):
    """The modules of a decoder that its stages ``layers`` hold, under the whole model's names
    (the project's Llama and Hugging Face decoders name them alike): the embedding on the first
    stage (``first``), the norm and the head on the last (``last``)."""

    lm_head: nn.Module

    def __init__(self, model: Any, layers: Sequence[int], *, first: bool, last: bool) -> None:
        super().__init__()
        self.first = first
        self.last = last
        self.model = _Body()
        if first:
            self.model.embed_tokens = model.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
        if last:
            self.model.norm = model.model.norm
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
    balanced). The project's :class:`~models.llama.Llama` and Hugging Face Llama-family decoders
    (``model.embed_tokens``, ``model.layers``, ``model.norm``, ``lm_head``) split."""
    if isinstance(model, Llama):
        num_layers = model.args.num_layers
        stage_type: type[LlamaStage] | type[HFDecoderStage] = LlamaStage
    elif _is_hf_decoder(model):
        num_layers = len(model.get_submodule("model.layers"))  # type: ignore[arg-type]
        stage_type = HFDecoderStage
    else:
        raise ValueError(
            f"{type(model).__name__} does not split into pipeline stages: the project's Llama "
            "(model.name) and Hugging Face decoders with model.embed_tokens, model.layers, "
            "model.norm and lm_head do. Use gang.pp_size=1."
        )
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


def _is_hf_decoder(model: nn.Module) -> bool:
    body = getattr(model, "model", None)
    return (
        hasattr(model, "lm_head")
        and hasattr(model, "config")
        and all(hasattr(body, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb"))
    )


@final
class HFDecoderStage(_DecoderStage):
    """The part of a Hugging Face decoder (Llama, Qwen2, Mistral and their kin) that pipeline
    stages hold, as :class:`LlamaStage` for the project's model. Attention runs as ``sdpa``
    without a mask (causal), so batches hold no padding: packed text, as ``task=pretrain`` makes.
    The rotary embedding (no parameters) is on every stage. Mixtures of experts split alike;
    with a load-balancing loss their stages pass their routers' sums on (``routers``)."""

    def __init__(self, model: Any, layers: Sequence[int], *, first: bool, last: bool) -> None:
        super().__init__(model, layers, first=first, last=last)
        self.config = model.config
        self.model.rotary_emb = model.model.rotary_emb
        self.routers = RouterStatistics.of(model, self.model.layers.values())
        """A mixture of experts with a load-balancing loss: the sums its routers pass on."""
        self.hf_weight_conversions = weight_conversions(model)
        """How the files' keys become the model's (a mixture of experts' are merged at load)."""

    def forward(self, x: Tensor, router_sums: Tensor | None = None) -> Tensor | tuple[Tensor, ...]:
        """The logits (last stage) or hidden states (others) of ``x``. With :attr:`routers`, the
        stages also pass on the router sums (:mod:`models.moe.routing`), and the last returns
        ``(logits, load-balancing loss)``."""
        import torch

        if self.routers is not None:
            self.routers.begin()
        if self.first:
            x = self.model.embed_tokens(x)
        position_ids = torch.arange(x.size(1), device=x.device)[None, :]
        position_embeddings = self.model.rotary_emb(x, position_ids)
        for layer in self.model.layers.values():
            out = layer(
                x,
                attention_mask=None,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
            )
            x = out[0] if isinstance(out, tuple) else out
        if self.last:
            x = self.lm_head(self.model.norm(x))
        if self.routers is None:
            return x
        router_sums = self.routers.add(router_sums, x)
        return (x, self.routers.loss(router_sums)) if self.last else (x, router_sums)


__all__ = [
    "HFDecoderStage",
    "LlamaStage",
    "StageFactory",
    "split_by_layers",
    "split_layers",
    "split_model",
]
