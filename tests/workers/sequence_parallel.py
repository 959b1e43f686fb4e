"""Two-rank checks of Ulysses attention (``runtime.parallel.sequence``), run in
``two_rank_checks.py``'s launch with its DP gang of two as the SP gang: each rank holds half of
every sequence, and its outputs and gradients must equal the matching half of one process's.

- ``attention_<path>``: the project's Llama attention function, causal with one key/value head
  and with a document mask and two, over the private (``_functional_collectives``) and the
  public all-to-all;
- ``hf_<implementation>``: a tiny Hugging Face Llama with one key/value head (repeated for the
  two ranks), its ``sdpa`` and ``eager`` attention wrapped, logits and every gradient.

Returns the largest absolute differences by check.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from gangs import FakeGang, Gangs, ReduceOperation
from models.llama import sdpa_attention
from runtime.parallel.sequence import UlyssesAttention, apply_sequence_parallel, sp_group

PRIVATE_APIS = "TRAINKIT_TORCH_PRIVATE_APIS"


def _sp_gangs(gangs: Gangs) -> Gangs:
    """Gangs whose SP gang is the two ranks (and DP one)."""
    fake = FakeGang(device=gangs.root.device)
    return Gangs(root=gangs.root, dp=fake, tp=fake, sp=gangs.root, dp_sp=gangs.root)


def _attention(gangs: Gangs, masked: bool) -> float:
    rank, size = gangs.root.rank, gangs.root.size
    generator = torch.Generator().manual_seed(3)
    q, upstream = (torch.randn(2, 4, 8, 16, generator=generator) for _ in range(2))
    # Grouped-query attention: 1 key/value head (repeated for the 2 SP ranks), or 2.
    kv_heads = 2 if masked else 1
    k, v = (torch.randn(2, kv_heads, 8, 16, generator=generator) for _ in range(2))
    mask = None
    if masked:
        documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1, 1, 1]])
        mask = (documents[:, None, :, None] == documents[:, None, None, :]) & torch.ones(
            8, 8, dtype=torch.bool
        ).tril()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = sdpa_attention(*full, mask)
    reference.backward(upstream)
    part = slice(rank * 8 // size, (rank + 1) * 8 // size)
    local = [t[:, :, part].clone().requires_grad_() for t in (q, k, v)]
    attention = UlyssesAttention(sp_group(_sp_gangs(gangs)), size, sdpa_attention)
    out = attention(*local, mask)
    out.backward(upstream[:, :, part])
    diffs = [(out - reference[:, :, part]).abs().max()]
    for mine, whole in zip(local, full, strict=True):
        assert mine.grad is not None and whole.grad is not None
        diffs.append((mine.grad - whole.grad[:, :, part]).abs().max())
    return float(torch.stack(diffs).detach().max())


def _hf(gangs: Gangs, implementation: str) -> float:
    import transformers

    rank, size = gangs.root.rank, gangs.root.size
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    config._attn_implementation = implementation
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    sp_model = apply_sequence_parallel(copy.deepcopy(model), _sp_gangs(gangs))
    input_ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).expand(2, -1)
    logits = model(input_ids=input_ids).logits
    logits.square().sum().backward()
    part = slice(rank * 16 // size, (rank + 1) * 16 // size)
    local = sp_model(input_ids=input_ids[:, part], position_ids=positions[:, part]).logits
    local.square().sum().backward()
    diffs = [(local - logits[:, part]).abs().max()]
    for (name, mine), whole in zip(sp_model.named_parameters(), model.parameters(), strict=True):
        assert mine.grad is not None and whole.grad is not None, name
        grad = mine.grad.clone()
        gangs.root.all_reduce(grad, ReduceOperation.SUM)  # the gradient over DP x SP
        diffs.append((grad - whole.grad).abs().max())
    return float(torch.stack(diffs).detach().max())


def run(gangs: Gangs) -> dict[str, Any]:
    before = os.environ.get(PRIVATE_APIS)
    results: dict[str, Any] = {}
    try:
        for path in ("private", "public"):
            os.environ[PRIVATE_APIS] = path
            results[f"attention_{path}"] = _attention(gangs, masked=False)
            results[f"attention_{path}_masked"] = _attention(gangs, masked=True)
    finally:
        if before is None:
            os.environ.pop(PRIVATE_APIS, None)
        else:
            os.environ[PRIVATE_APIS] = before
    for implementation in ("sdpa", "eager"):
        results[f"hf_{implementation}"] = _hf(gangs, implementation)
    return results
