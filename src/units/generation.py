"""How GRPO draws completions: the :class:`CompletionGenerator` interface, and
:class:`TransformersGenerator`, the policy's own ``generate`` with a KV cache.

A generator gets the token ids of a micro-batch's prompts and returns ``num_generations``
completions of each, prompt-major (the group of a prompt is consecutive), each a list of token
ids that ends with EOS unless it was cut at ``max_completion_length``. It must draw the same
completions for the same ``(step_nr, micro_nr)`` and rank, so a resumed run draws what the
uninterrupted one drew. A server (vLLM, say) fits behind the same interface: it would receive
the policy's weights before each step's first call (see docs/rl.md).
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import torch
from torch import nn

from trainkit_utils.modules import unwrap_model


class CompletionGenerator(Protocol):
    def generate(
        self, prompt_ids: list[list[int]], *, num_generations: int, step_nr: int, micro_nr: int
    ) -> list[list[int]]:
        """``num_generations`` completions of each prompt, the groups one after the other."""
        ...


def sampling_seed(seed: int, step_nr: int, micro_nr: int, rank: int) -> int:
    """A seed of its own for each step, micro-batch and rank, from the run's seed."""
    digest = hashlib.sha256(f"grpo|{seed}|{step_nr}|{micro_nr}|{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class TransformersGenerator:
    """Samples with the policy's ``generate`` (Hugging Face models), KV cache on, in eval mode,
    under a generator seeded from ``(seed, step_nr, micro_nr, rank)``: the global RNG is left
    as it was. ``synced``: every rank runs as many forwards as the longest (FSDP2, TP), so the
    sharded model's collectives line up; the model is never gathered whole on one rank."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_completion_length: int,
        temperature: float,
        top_p: float,
        eos_ids: list[int],
        pad_id: int,
        seed: int,
        rank: int = 0,
        synced: bool = False,
    ) -> None:
        self.model = model
        self.max_completion_length, self.temperature, self.top_p = (
            max_completion_length,
            temperature,
            top_p,
        )
        self.eos_ids, self.pad_id, self.seed, self.rank = eos_ids, pad_id, seed, rank
        self.synced = synced

    def generate(
        self, prompt_ids: list[list[int]], *, num_generations: int, step_nr: int, micro_nr: int
    ) -> list[list[int]]:
        model = unwrap_model(self.model)
        device = next(iter(model.parameters())).device
        rows = [ids for ids in prompt_ids for _ in range(num_generations)]
        width = max(len(ids) for ids in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for i, ids in enumerate(rows):
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            mask[i, width - len(ids) :] = 1
        was_training = model.training
        model.eval()
        devices = [device] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                torch.manual_seed(sampling_seed(self.seed, step_nr, micro_nr, self.rank))
                output = model.generate(  # type: ignore[operator]
                    input_ids=input_ids.to(device),
                    attention_mask=mask.to(device),
                    do_sample=True,
                    temperature=self.temperature,
                    top_p=self.top_p,
                    top_k=0,
                    max_new_tokens=self.max_completion_length,
                    eos_token_id=self.eos_ids,
                    pad_token_id=self.pad_id,
                    use_cache=True,
                    synced_gpus=self.synced,
                )
        finally:
            model.train(was_training)
        completions = []
        for row in output[:, width:].tolist():
            ends = [i for i, token in enumerate(row) if token in self.eos_ids]
            completions.append(row[: ends[0] + 1] if ends else row)
        return completions
