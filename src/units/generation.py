"""How GRPO draws completions: the :class:`CompletionGenerator` interface, and
:class:`TransformersGenerator`, the policy's own ``generate`` with a KV cache.

A generator gets the token ids of a micro-batch's prompts and returns ``num_generations``
completions of each, prompt-major (the group of a prompt is consecutive), each a list of token
ids that ends with EOS unless it was cut at ``max_completion_length``. It must draw the same
completions of a prompt at the same ``step_nr`` wherever the prompt is (rank, micro-batch, its
neighbours), so a resumed run draws what the uninterrupted one drew, and DP=2 with accumulation
what one process with the whole batch draws. A server (vLLM, say) fits behind the same interface: it would receive
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
        self, prompt_ids: list[list[int]], *, num_generations: int, step_nr: int
    ) -> list[list[int]]:
        """``num_generations`` completions of each prompt, the groups one after the other."""
        ...


def sampling_seed(seed: int, step_nr: int, prompt_ids: list[int]) -> int:
    """A seed of its own for each step and prompt, from the run's seed."""
    digest = hashlib.sha256(f"grpo|{seed}|{step_nr}|{prompt_ids}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class TransformersGenerator:
    """Samples with the policy's ``generate`` (Hugging Face models), KV cache on, in eval mode,
    one prompt's group at a time under the RNG seeded from ``(seed, step_nr, prompt)``: no
    padding, and the global RNG is left as it was. ``synced``: every rank runs as many forwards
    as the longest (for a model whose forward makes collectives: FSDP2, TP), so they line up;
    the model is never gathered whole on one rank."""

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
        synced: bool = False,
    ) -> None:
        self.model = model
        self.max_completion_length, self.temperature, self.top_p = (
            max_completion_length,
            temperature,
            top_p,
        )
        self.eos_ids, self.pad_id, self.seed = eos_ids, pad_id, seed
        self.synced = synced

    def generate(
        self, prompt_ids: list[list[int]], *, num_generations: int, step_nr: int
    ) -> list[list[int]]:
        model = unwrap_model(self.model)
        device = next(iter(model.parameters())).device
        was_training = model.training
        model.eval()
        devices = [device] if device.type == "cuda" else []
        completions = []
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                for ids in prompt_ids:
                    torch.manual_seed(sampling_seed(self.seed, step_nr, ids))
                    input_ids = torch.tensor([ids] * num_generations, device=device)
                    output = model.generate(  # type: ignore[operator]
                        input_ids=input_ids,
                        attention_mask=torch.ones_like(input_ids),
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
                    completions += [self._cut(row) for row in output[:, len(ids) :].tolist()]
        finally:
            model.train(was_training)
        return completions

    def _cut(self, row: list[int]) -> list[int]:
        """The tokens up to the first EOS, which is kept."""
        ends = [i for i, token in enumerate(row) if token in self.eos_ids]
        return row[: ends[0] + 1] if ends else row
