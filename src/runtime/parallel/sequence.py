"""Sequence parallelism, DeepSpeed-Ulysses style: each rank of the SP gang holds
``seq_len / sp_size`` positions of every sequence, and attention alone sees whole sequences.

Around each attention call an all-to-all turns this rank's ``[local sequence, all heads]`` into
``[whole sequence, its heads]``, the attention the model already uses runs on it, and a second
all-to-all turns the result back. Everything else (embeddings, norms, MLPs, the loss) works on
the local positions unchanged. The data side is :class:`runtime.data.sequence.SequenceSplitReader`.

The all-to-all is autograd-aware. On the tested torch versions (:mod:`gangs.torch_versions`) it
is the private ``_functional_collectives.all_to_all_single_autograd``; elsewhere a small
``autograd.Function`` over the public ``dist.all_to_all_single`` (an even all-to-all is its own
inverse, so its backward is one more of it). Both give the same bits.

:func:`apply_sequence_parallel` wraps the attention of

- the project's Llama (:class:`models.llama.Attention`'s ``attention_fn``, around its sdpa), and
- a Hugging Face model whose ``config._attn_implementation`` is ``sdpa`` or ``eager``: the
  function it names is registered with ``transformers``' ``AttentionInterface`` under a name of
  ours (``trainkit_sp_sdpa``, ``trainkit_sp_eager``) that calls it between the all-to-alls. No
  modeling code changes; attention is causal over the whole sequence (the recipes give Hugging
  Face models no padding or document mask), so a model whose sliding window is shorter than
  the sequence is refused (a window as long as the sequence masks nothing, and runs).

Any other model is refused in one line. Heads must divide by ``sp_size`` (after tensor
parallelism has split them: ``sp_size x tp_size`` in all); key/value heads are repeated when
``sp_size`` does not divide them.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module

from gangs import Gang, Gangs, ProcessGroupGang
from gangs.torch_versions import private_apis_supported
from models.llama import Attention as LlamaAttention
from models.llama import Llama

HF_IMPLEMENTATIONS = ("sdpa", "eager")
"""The attention implementations of a Hugging Face model that SP wraps."""

_HF_NAME = "trainkit_sp_{}"

_SP_GROUPS: weakref.WeakKeyDictionary[Module, tuple[dist.ProcessGroup, int]] = (
    weakref.WeakKeyDictionary()
)
"""The SP group and size of each Hugging Face attention module under SP."""


class SequenceParallelError(ValueError):
    """A layout that sequence parallelism cannot run, with what would."""


def check_sequence_length(seq_len: int, sp_size: int) -> None:
    """``seq_len`` must divide evenly over the SP ranks."""
    if seq_len % sp_size != 0:
        fits = [
            str(n) for n in (seq_len - seq_len % sp_size, seq_len + sp_size - seq_len % sp_size)
        ]
        raise SequenceParallelError(
            f"seq_len {seq_len} does not split over sp_size {sp_size}: each SP rank keeps "
            f"seq_len / sp_size positions. Use a seq_len that sp_size divides (e.g. "
            f"{' or '.join(f for f in fits if f != '0')})."
        )


def check_heads(num_heads: int, sp_size: int, tp_size: int) -> None:
    """The query heads must split over TP, then over SP."""
    if num_heads % (sp_size * tp_size) != 0:
        fits = [str(n) for n in range(1, num_heads + 1) if num_heads % (n * tp_size) == 0]
        raise SequenceParallelError(
            f"The model's {num_heads} attention heads do not split over sp_size {sp_size} x "
            f"tp_size {tp_size}: each SP rank attends with num_heads / (sp_size x tp_size) "
            f"heads. With tp_size {tp_size}, use sp_size {' or '.join(fits)}."
        )


# --- the all-to-all ----------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """An even ``all_to_all_single`` on dim 0 over ``group``; its backward is another one."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        x = x.contiguous()  # empty_like keeps strides: both must be dense in dim-0 order
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def all_to_all_dim0(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Chunk ``i`` of dim 0 goes to rank ``i`` of ``group``; chunk ``i`` of the result came from
    rank ``i``. Differentiable (see the module docstring for the two paths)."""
    if private_apis_supported():
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        result: Tensor = all_to_all_single_autograd(x.contiguous(), None, None, group)
        return result
    out: Tensor = _AllToAll.apply(x, group)  # type: ignore[no-untyped-call]
    return out


def heads_to_sequence(x: Tensor, group: dist.ProcessGroup, size: int) -> Tensor:
    """``[batch, heads, local seq, dim]`` -> ``[batch, heads / size, seq, dim]``."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, size, h // size, s, d).transpose(0, 1)  # [size, b, h/size, s, d]
    gathered = all_to_all_dim0(chunks, group)  # [source rank, b, h/size, s, d]
    return gathered.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def sequence_to_heads(x: Tensor, group: dist.ProcessGroup, size: int) -> Tensor:
    """``[batch, heads / size, seq, dim]`` -> ``[batch, heads, seq / size, dim]``."""
    b, h, s, d = x.shape
    chunks = x.reshape(b, h, size, s // size, d).permute(2, 0, 1, 3, 4)  # [size, b, h, s/size, d]
    gathered = all_to_all_dim0(chunks, group)  # [source rank, b, h, s/size, d]
    return gathered.transpose(0, 1).reshape(b, h * size, s // size, d)


def repeat_kv_for(num_heads: int, num_kv_heads: int, size: int) -> int:
    """How many times to repeat each key/value head so that ``size`` divides them and each
    still serves whole groups of query heads (1: no repeat)."""
    for factor in range(1, num_heads // num_kv_heads + 1):
        kv = num_kv_heads * factor
        if kv % size == 0 and num_heads % kv == 0:
            return factor
    return num_heads // num_kv_heads


# --- the project's Llama -----------------------------------------------------------------------


class UlyssesAttention:
    """An ``attention_fn`` of :class:`models.llama.Attention` (``(q, k, v, mask) -> out``, all
    ``[batch, heads, seq, dim]``, keys and values with their own, fewer heads) run over the SP
    ``group``: q, k, v hold this rank's positions; ``mask`` (a document mask, or None: causal)
    spans the whole sequence. Key/value heads are repeated only as far as the SP size needs."""

    def __init__(self, group: dist.ProcessGroup, size: int, inner: Callable[..., Tensor]) -> None:
        self.group, self.size, self.inner = group, size, inner

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        factor = repeat_kv_for(q.size(1), k.size(1), self.size)
        if factor > 1:
            k = k.repeat_interleave(factor, dim=1)
            v = v.repeat_interleave(factor, dim=1)
        q, k, v = (heads_to_sequence(t, self.group, self.size) for t in (q, k, v))
        out = self.inner(q, k, v, mask)
        return sequence_to_heads(out, self.group, self.size)


# --- Hugging Face ------------------------------------------------------------------------------


class _GroupsOf:
    """The attention module as the inner function sees it, with its key/value groups as they
    are after the all-to-all (repeating key/value heads changes them)."""

    def __init__(self, module: Module, groups: int) -> None:
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _hf_attention(implementation: str) -> Callable[..., tuple[Tensor, Any]]:
    """The function registered as ``trainkit_sp_<implementation>``: the model's own attention of
    that kind between the all-to-alls. The SP group comes from the module (set by
    :func:`apply_sequence_parallel`), so one registration serves every model."""

    def attention(
        module: Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Tensor, Any]:
        group, size = _SP_GROUPS[module]
        window = kwargs.pop("sliding_window", None)
        if window is not None and window < query.size(2) * size:  # check_model refuses these
            raise SequenceParallelError(
                f"Sequence parallelism cannot wrap a sliding window ({window}) shorter than the "
                f"sequence ({query.size(2) * size})."
            )
        factor = repeat_kv_for(query.size(1), key.size(1), size)
        if factor > 1:
            key = key.repeat_interleave(factor, dim=1)
            value = value.repeat_interleave(factor, dim=1)
        query, key, value = (heads_to_sequence(t, group, size) for t in (query, key, value))
        groups = query.size(1) // key.size(1)
        seq = query.size(2)
        if implementation == "sdpa":
            inner = _hf_sdpa()
            mask = None  # sdpa's own causal mask over the whole sequence
        else:
            inner = sys.modules[type(module).__module__].eager_attention_forward
            mask = torch.full(
                (seq, seq), torch.finfo(query.dtype).min, dtype=query.dtype, device=query.device
            ).triu(1)[None, None]
        out, weights = inner(_GroupsOf(module, groups), query, key, value, mask, *args, **kwargs)
        # transformers returns [batch, seq, heads, dim]
        out = sequence_to_heads(out.transpose(1, 2), group, size).transpose(1, 2)
        return out, weights

    return attention


def _hf_sdpa() -> Callable[..., tuple[Tensor, Any]]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward  # type: ignore[no-any-return]


def _register_hf_attention() -> None:
    from transformers import AttentionInterface

    for implementation in HF_IMPLEMENTATIONS:
        AttentionInterface.register(_HF_NAME.format(implementation), _hf_attention(implementation))


def _hf_attention_modules(model: Module) -> list[Module]:
    """The attention modules of a Hugging Face model: those with a ``config``, a ``head_dim``
    and a ``num_key_value_groups``, as transformers' attention classes have, or (GPT-2's, all
    heads their own key/value heads) a causal ``...Attention`` without one."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "config")
        and hasattr(m, "head_dim")
        and (
            hasattr(m, "num_key_value_groups")
            or (type(m).__name__.endswith("Attention") and getattr(m, "is_causal", False) is True)
        )
    ]


# --- applying it -------------------------------------------------------------------------------


def sp_group(gangs: Gangs) -> dist.ProcessGroup:
    """The process group of the SP gang."""
    gang: Gang = gangs.sp
    if not isinstance(gang, ProcessGroupGang):
        raise SequenceParallelError(
            f"Sequence parallelism needs an SP gang of processes, but it is {gang!r}. Make the "
            "gangs with setup_gangs(sp_size=N) under torchrun."
        )
    return gang.as_process_group()


def check_model(model: Module, sp_size: int, tp_size: int, seq_len: int | None = None) -> str:
    """What :func:`apply_sequence_parallel` would wrap in ``model``: ``"llama"`` (the project's)
    or the Hugging Face attention implementation; a one-line :class:`SequenceParallelError`
    for a model it cannot wrap or heads that ``sp_size x tp_size`` does not divide. A sliding
    window is refused when it is shorter than ``seq_len`` (any window when it is None)."""
    if isinstance(model, Llama):
        check_heads(model.args.num_heads, sp_size, tp_size)
        return "llama"
    config = getattr(model, "config", None)
    if config is None or not _hf_attention_modules(model):
        raise SequenceParallelError(
            f"Sequence parallelism cannot wrap the attention of {type(model).__name__}: it "
            "wraps the project's Llama and Hugging Face models with sdpa or eager attention. "
            "Set gang.sp_size to 1 for this model."
        )
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in HF_IMPLEMENTATIONS:
        raise SequenceParallelError(
            f"Sequence parallelism wraps sdpa and eager attention, but {type(model).__name__} "
            f"uses {implementation!r}. Load it with attn_implementation='sdpa', or set "
            "gang.sp_size to 1."
        )
    window = _sliding_window(model, config)
    if window is not None and (seq_len is None or window < seq_len):
        length = "" if seq_len is None else f", shorter than data.seq_len ({seq_len})"
        raise SequenceParallelError(
            f"Sequence parallelism runs causal attention over the whole sequence, but "
            f"{type(model).__name__} attends within a sliding window of {window} tokens"
            f"{length}. Set gang.sp_size to 1 for this model, or data.seq_len to at most "
            f"{window}."
        )
    check_heads(config.num_attention_heads, sp_size, tp_size)
    return str(implementation)


def _sliding_window(model: Module, config: Any) -> int | None:
    """The smallest sliding window a layer of the Hugging Face ``model`` attends within: its
    attention modules' ``sliding_window`` (Qwen2, Gemma 2), else the config's (Mistral)."""
    modules = _hf_attention_modules(model)
    if any(hasattr(module, "sliding_window") for module in modules):
        windows = [getattr(module, "sliding_window", None) for module in modules]
        return min((w for w in windows if w is not None), default=None)
    window = getattr(config, "sliding_window", None)
    return window if isinstance(window, int) else None


def apply_sequence_parallel(model: Module, gangs: Gangs, seq_len: int | None = None) -> Module:
    """Wrap the attention of ``model`` for the SP gang (a no-op without SP), before data
    parallelism wraps the model; :func:`check_model` refuses what it cannot wrap (a sliding
    window shorter than ``seq_len``, the length of the sequences it trains on)."""
    size = gangs.sp.size
    if size == 1:
        return model
    kind = check_model(model, size, gangs.tp.size, seq_len)
    group = sp_group(gangs)
    if kind == "llama":
        for module in model.modules():
            if isinstance(module, LlamaAttention):
                module.attention_fn = UlyssesAttention(group, size, module.attention_fn)
        return model
    _register_hf_attention()
    for module in _hf_attention_modules(model):
        _SP_GROUPS[module] = (group, size)
    for sub in model.modules():
        sub_config = getattr(sub, "config", None)
        if getattr(sub_config, "_attn_implementation", None) == kind:
            sub_config._attn_implementation = _HF_NAME.format(kind)  # type: ignore[union-attr]
    return model


__all__ = [
    "HF_IMPLEMENTATIONS",
    "SequenceParallelError",
    "UlyssesAttention",
    "all_to_all_dim0",
    "apply_sequence_parallel",
    "check_heads",
    "check_model",
    "check_sequence_length",
    "heads_to_sequence",
    "repeat_kv_for",
    "sequence_to_heads",
]
