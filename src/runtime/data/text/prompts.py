"""Prompts for online RL (GRPO): a record's ``prompt`` as text or chat messages, tokenized, with
the record's other fields kept for the reward functions.

A record (JSONL or Parquet, as the instruction data reads them) holds ``prompt``: a string, or
a list of ``{"role", "content"}`` messages (TRL's conversational format) rendered with the
tokenizer's chat template and its generation prompt. Text becomes ``[BOS] prompt`` (BOS where the
tokenizer has one, as TRL's tokenization adds it); a chat template writes its own. A prompt of
more than ``max_prompt_len`` tokens is left out and counted (``num_dropped``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, final

import torch

from runtime.data.text.files import TextDataError
from runtime.data.text.instructions import chat_messages, chat_template, converted_records
from runtime.data.text.tokenizer import Tokenizer
from trainkit_utils.arguments import check_positive

log = logging.getLogger(__name__)


class PromptExample(NamedTuple):
    """One prompt: as the record gave it, its tokens, and the record's other fields."""

    prompt: Any
    prompt_ids: list[int]
    columns: dict[str, Any]


@final
@dataclass
class PromptBatch:
    """A micro-batch of prompts (``units.grpo.PromptBatch``): lists, one entry a prompt; the
    unit pads and places the tokens itself."""

    prompts: list[Any]
    prompt_ids: list[list[int]]
    columns: dict[str, list[Any]] = field(default_factory=dict)
    num_bad_lines: int = 0

    def to(self, device: torch.device, non_blocking: bool = False) -> PromptBatch:
        return self

    @property
    def batch_size(self) -> int:
        return len(self.prompts)


class PromptDataset(torch.utils.data.Dataset[PromptExample]):
    """The prompts of ``path`` (JSONL or Parquet files, a directory or a glob), in file order."""

    def __init__(
        self,
        path: str | Path,
        *,
        tokenizer: Tokenizer,
        max_prompt_len: int,
        prompt_field: str = "prompt",
        skip_bad_lines: bool = False,
    ) -> None:
        check_positive("max_prompt_len", max_prompt_len)
        self.num_bad_lines = 0
        self.num_dropped = 0
        self._tokenizer = tokenizer
        self._template: Any = None
        self._examples: list[PromptExample] = []
        examples = converted_records(
            path,
            lambda record: self._example(record, prompt_field),
            skip_bad_lines=skip_bad_lines,
            bad_lines=self,
        )
        for example in examples:
            if len(example.prompt_ids) > max_prompt_len:
                self.num_dropped += 1
            else:
                self._examples.append(example)
        if not self._examples:
            raise TextDataError(
                f"{path} holds no prompt of at most {max_prompt_len} tokens ({self.num_dropped} "
                f"longer, {self.num_bad_lines} unreadable). Raise data.seq_len, or give shorter "
                "prompts."
            )
        if self.num_dropped:
            log.warning(
                "%d prompts of %s were left out: longer than %d tokens.",
                self.num_dropped,
                path,
                max_prompt_len,
            )

    def __len__(self) -> int:
        return len(self._examples)

    def __getitem__(self, index: int) -> PromptExample:
        return self._examples[index]

    def _example(self, record: Any, prompt_field: str) -> PromptExample:
        if not isinstance(record, dict):
            raise TextDataError(f"the record is a {type(record).__name__}, not a JSON object")
        if prompt_field not in record:
            raise TextDataError(
                f"the record has no field {prompt_field!r} (it has {sorted(record)}); set "
                "grpo.prompt_field"
            )
        prompt = record[prompt_field]
        columns = {k: v for k, v in record.items() if k != prompt_field}
        tokenizer = self._tokenizer
        if isinstance(prompt, list):
            if self._template is None:
                self._template = chat_template(tokenizer, needed_by="A chat-message prompt")
            messages = chat_messages(record, prompt_field)
            text = str(self._template.render(messages=messages, add_generation_prompt=True))
            return PromptExample(messages, tokenizer.encode(text), columns)
        if not isinstance(prompt, str):
            raise TextDataError(
                f"the field {prompt_field!r} is {type(prompt).__name__}: give a string, or chat "
                "messages"
            )
        bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
        ids = bos + tokenizer.encode(prompt)
        if not ids:
            raise TextDataError("the prompt has no token, and the tokenizer no BOS to start it")
        return PromptExample(prompt, ids, columns)


def collate_prompts(examples: list[PromptExample], *, num_bad_lines: int = 0) -> PromptBatch:
    """The examples as one batch; a field missing from some records is None there."""
    keys = sorted({k for example in examples for k in example.columns})
    return PromptBatch(
        prompts=[e.prompt for e in examples],
        prompt_ids=[e.prompt_ids for e in examples],
        columns={k: [e.columns.get(k) for e in examples] for k in keys},
        num_bad_lines=num_bad_lines,
    )
