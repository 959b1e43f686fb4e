"""A Llama-style decoder for the GPU cases: RMSNorm, rotary positions, grouped-query attention
and a SwiGLU feed-forward, on random tokens.

The full size has the shape of Llama 3.2 1B (2048 wide, 16 blocks, 32 query and 8 key-value
heads, a feed-forward of 8192) with a 32k vocabulary: 1.1 B parameters. ``quick`` is a small
one for smoke runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import final

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@final
@dataclass(frozen=True)
class LlamaShape:
    dim: int = 2048
    num_layers: int = 16
    num_heads: int = 32
    num_kv_heads: int = 8
    ffn_dim: int = 8192
    vocab_size: int = 32_000
    seq_len: int = 2048
    batch_size: int = 4
    """Sequences per step."""

    @staticmethod
    def of(*, quick: bool) -> LlamaShape:
        if quick:
            return LlamaShape(
                dim=512,
                num_layers=4,
                num_heads=8,
                num_kv_heads=2,
                ffn_dim=1536,
                vocab_size=8192,
                seq_len=512,
                batch_size=4,
            )
        return LlamaShape()

    def flops_per_token(self, num_parameters: int) -> float:
        """Forward and backward: 6 per parameter, plus attention's scores and weighted sum
        (12 * layers * dim * seq_len; halved for the causal mask is left out, as is usual)."""
        return 6.0 * num_parameters + 12.0 * self.num_layers * self.dim * self.seq_len


def rotary_tables(shape: LlamaShape, device: torch.device) -> tuple[Tensor, Tensor]:
    head_dim = shape.dim // shape.num_heads
    inverse = 1.0 / (500_000.0 ** (torch.arange(0, head_dim, 2, device=device) / head_dim))
    angles = torch.outer(torch.arange(shape.seq_len, device=device), inverse)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[: x.size(-2)], sin[: x.size(-2)]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class LlamaBlock(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = shape.num_heads, shape.num_kv_heads
        self.head_dim = shape.dim // shape.num_heads
        kv_dim = self.head_dim * shape.num_kv_heads
        self.attn_norm = nn.RMSNorm(shape.dim)
        self.wq = nn.Linear(shape.dim, shape.dim, bias=False)
        self.wkv = nn.Linear(shape.dim, 2 * kv_dim, bias=False)
        self.wo = nn.Linear(shape.dim, shape.dim, bias=False)
        self.ffn_norm = nn.RMSNorm(shape.dim)
        self.w_gate_up = nn.Linear(shape.dim, 2 * shape.ffn_dim, bias=False)
        self.w_down = nn.Linear(shape.ffn_dim, shape.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = (
            t.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
            for t in self.wkv(h).chunk(2, dim=-1)
        )
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(batch, seq, -1))
        gate, up = self.w_gate_up(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.shape = shape
        self.embed = nn.Embedding(shape.vocab_size, shape.dim)
        self.blocks = nn.ModuleList(LlamaBlock(shape) for _ in range(shape.num_layers))
        self.norm = nn.RMSNorm(shape.dim)
        self.head = nn.Linear(shape.dim, shape.vocab_size, bias=False)
        cos, sin = rotary_tables(shape, self.embed.weight.device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.head(self.norm(x))

    def compile_blocks(self) -> None:
        """One compiled graph per block, shared by the blocks of one shape."""
        for block in self.blocks:
            block.compile()


def summed_loss(model: nn.Module, tokens: Tensor) -> tuple[Tensor, int]:
    """Next-token cross entropy summed over the targets, in float32, and their count."""
    logits = model(tokens[:, :-1])
    targets = tokens[:, 1:]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
    return loss, targets.numel()


def random_tokens(shape: LlamaShape, num_sequences: int, *, seed: int = 0) -> Tensor:
    """``num_sequences`` windows of ``seq_len + 1`` random tokens, on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(
        0, shape.vocab_size, (num_sequences, shape.seq_len + 1), generator=generator
    )
