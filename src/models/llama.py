"""A Llama-style decoder (RMSNorm, rotary positions, SwiGLU, grouped-query attention).

The module and parameter names are those of Hugging Face's ``LlamaForCausalLM``
(``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``, ...) and the rotary embedding is
computed the same way, so a checkpoint of this model is a Hugging Face Llama checkpoint: export
writes it with :func:`hf_config` as ``config.json``, and ``from_pretrained`` computes the same
logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_dim: int
    max_seq_len: int = 2048
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.dim % self.num_heads != 0:
            raise ValueError(
                f"The model's dim ({self.dim}) must be a multiple of num_heads ({self.num_heads})."
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}): each key/value head serves a group of query heads."
            )


PRESETS: dict[str, dict[str, int]] = {
    "llama_debug": {"dim": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "ffn_dim": 192},
    "llama_125m": {
        "dim": 768,
        "num_layers": 12,
        "num_heads": 12,
        "num_kv_heads": 4,
        "ffn_dim": 2048,
    },
    "llama_1b": {
        "dim": 2048,
        "num_layers": 16,
        "num_heads": 32,
        "num_kv_heads": 8,
        "ffn_dim": 8192,
    },
    "llama_8b": {
        "dim": 4096,
        "num_layers": 32,
        "num_heads": 32,
        "num_kv_heads": 8,
        "ffn_dim": 14336,
    },
}


def llama_args(name: str, *, vocab_size: int, max_seq_len: int) -> LlamaArgs:
    """The preset ``name`` (one of :data:`PRESETS`) for a tokenizer of ``vocab_size`` ids."""
    if name not in PRESETS:
        raise ValueError(
            f"model.name must be one of {', '.join(sorted(PRESETS))}, but is '{name}' instead."
        )
    return LlamaArgs(vocab_size=vocab_size, max_seq_len=max_seq_len, **PRESETS[name])


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_cos_sin(args: LlamaArgs, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin ``[*positions.shape, head_dim]`` of the rotary embedding, in float32."""
    head_dim = args.dim // args.num_heads
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
    inv_freq = 1.0 / (args.rope_theta ** (exponents / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_and_mask(
    args: LlamaArgs, x: Tensor, document_ids: Tensor | None, positions: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The rotary cos and sin of the hidden states ``x`` ``[batch, seq, dim]``, and the attention
    mask. ``positions`` (``[batch, seq]``): each token's position, in its packed document or in
    the whole sequence of which ``x`` is a part; None: ``0 .. seq - 1``. The mask is None (causal)
    without ``document_ids``, else causal within each packed document (``document_ids`` of the
    whole sequences, ``[batch, seq]``)."""
    if positions is None:
        cos, sin = rotary_cos_sin(args, torch.arange(x.size(1), device=x.device), x.dtype)
    else:
        cos, sin = (t.unsqueeze(1) for t in rotary_cos_sin(args, positions, x.dtype))
    if document_ids is None:
        return cos, sin, None
    seq_len = document_ids.size(1)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=x.device).tril()
    mask = (document_ids[:, None, :, None] == document_ids[:, None, None, :]) & causal
    return cos, sin, mask


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Attention of ``[batch, heads, seq, head_dim]`` queries, keys and values: causal, or
    within ``mask`` (``[batch, 1, seq, seq]``, True where a query may see a key). Keys and
    values may have fewer heads, each serving a group of consecutive query heads, as in
    Hugging Face."""
    groups = q.size(1) // k.size(1)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


AttentionFn = Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]
"""What :class:`Attention` calls between its projections: :func:`sdpa_attention`, or a wrapper
of it (sequence parallelism's all-to-alls, :mod:`runtime.parallel.sequence`)."""


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.attention_fn: AttentionFn = sdpa_attention
        self.head_dim = args.dim // args.num_heads
        kv_dim = args.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.k_proj = nn.Linear(args.dim, kv_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, kv_dim, bias=False)
        self.o_proj = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its own heads.
        q, k, v = (
            proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # Keys and values keep their own heads: attention_fn repeats them (after sequence
        # parallelism's all-to-all, which then moves fewer of them).
        out = self.attention_fn(q, k, v, mask)
        result: Tensor = self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
        return result


class FeedForward(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.up_proj = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.down_proj = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        result: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return result


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.mlp = FeedForward(args)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        result: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return result


class LlamaBody(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)


class Llama(nn.Module):
    """``forward(input_ids [batch, seq]) -> logits [batch, seq, vocab_size]``.

    With ``document_ids`` and ``positions`` (of packed sequences), attention stays inside each
    document and rotary positions restart at each document's first token. ``position_ids``
    (Hugging Face's name) gives the rotary positions alone, attention staying causal.

    Under sequence parallelism (:mod:`runtime.parallel.sequence`) ``input_ids`` and the
    positions are this rank's part of each sequence, and ``document_ids`` the whole sequence's:
    attention sees the whole sequence.
    """

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaBody(args)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(
        self,
        input_ids: Tensor,
        *,
        document_ids: Tensor | None = None,
        positions: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        x = self.model.embed_tokens(input_ids)
        if positions is None or document_ids is None:
            # No packed documents: positions in the whole sequence (a part of it under SP).
            positions, document_ids = position_ids, None
        cos, sin, mask = rotary_and_mask(self.args, x, document_ids, positions)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        result: Tensor = self.lm_head(self.model.norm(x))
        return result

    def init_module(self, name: str, module: nn.Module) -> None:
        """Hugging Face's initialization: normal(0, init_std) weights, RMSNorm weights of one.

        An ``init_fn`` for ``materialize_model``, so the weights depend on the seed alone.
        """
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.args.init_std)
        elif isinstance(module, nn.RMSNorm):
            module.reset_parameters()
        else:
            raise ValueError(f"Module '{name}' ({type(module).__name__}) has no initialization.")

    def flops_per_token(self, seq_len: int) -> float:
        """Forward and backward FLOPs per token: 6 per weight, plus attention's scores and
        weighted sum (12 * layers * dim * seq_len)."""
        num_params = sum(p.numel() for p in self.parameters())
        return 6.0 * num_params + 12.0 * self.args.num_layers * self.args.dim * seq_len


def tensor_parallel_plan(model: Llama) -> dict[str, ParallelStyle]:
    """Attention and MLP projections, Megatron-style: column-wise in, row-wise out. Both the
    query and the key/value heads are split, so tp_size must divide num_kv_heads."""
    plan: dict[str, ParallelStyle] = {}
    for i in range(len(model.model.layers)):
        prefix = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{prefix}.self_attn.{name}"] = ColwiseParallel()
        plan[f"{prefix}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{prefix}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{prefix}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{prefix}.mlp.down_proj"] = RowwiseParallel()
    return plan


def hf_config(args: LlamaArgs, *, bos_id: int | None, eos_id: int) -> dict[str, Any]:
    """The ``config.json`` of Hugging Face's ``LlamaForCausalLM`` for this model."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "initializer_range": args.init_std,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def describe(args: LlamaArgs) -> str:
    num_params = args.vocab_size * args.dim * 2 + args.num_layers * (
        2 * args.dim * args.dim
        + 2 * args.dim * (args.num_kv_heads * args.dim // args.num_heads)
        + 3 * args.dim * args.ffn_dim
    )
    return f"{num_params / 1e6:.1f}M parameters ({asdict(args)})"


__all__ = [
    "PRESETS",
    "AttentionFn",
    "DecoderLayer",
    "Llama",
    "LlamaArgs",
    "hf_config",
    "llama_args",
    "sdpa_attention",
    "tensor_parallel_plan",
]
