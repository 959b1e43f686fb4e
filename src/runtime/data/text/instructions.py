"""Instruction data for fine-tuning: prompt and response pairs (or chat messages), tokenized, with
targets on the response tokens only, in batches of similar length instead of packed.

Each example becomes ``[BOS] prompt response [EOS]``; its targets are the next tokens over the
response and the EOS, and every prompt and padding position has the target ``IGNORE_INDEX``, so
neither the loss nor ``num_targets`` counts it. The examples are held in memory (instruction sets
are small next to pretraining corpora) and tokenized when the dataset is built.

Order: the examples are shuffled once by ``seed``, then sorted by length inside windows of
``bucket_size`` examples, so that a batch of consecutive examples pads little. Read the dataset
with ``MapDataReader(shuffle=False, ...)``: its position (examples taken) then resumes exactly at
any data-parallel size. Every epoch visits the same order.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, final

import torch
from torch import Tensor

from runtime.data.text.files import TextDataError, find_files
from runtime.data.text.tokenizer import HuggingFaceTokenizer, Tokenizer
from trainkit_utils.arguments import check_positive
from units.lm import IGNORE_INDEX

log = logging.getLogger(__name__)


@final
@dataclass
class InstructionBatch:
    """A micro-batch of examples padded to the longest; ``target_ids`` is ``IGNORE_INDEX`` except
    on response tokens, and ``num_targets`` counts the response tokens."""

    input_ids: Tensor  # [batch_size, length], int64
    target_ids: Tensor  # [batch_size, length], int64
    num_targets: int
    positions: Tensor | None = None  # [batch_size, length], int64
    """Set under sequence parallelism only (:mod:`runtime.data.sequence`): where this rank's
    part of each example sits in the whole."""

    @property
    def batch_size(self) -> int:
        return self.input_ids.size(0)


@final
@dataclass(frozen=True)
class InstructionFields:
    """Where an example's text is: ``prompt``/``response`` fields, or a chat ``messages`` list
    rendered with the tokenizer's chat template (the last message is the response)."""

    prompt: str = "prompt"
    response: str = "response"
    messages: str | None = None


@final
class InstructionDataset(torch.utils.data.Dataset[tuple[list[int], int]]):
    """Tokenized examples: ``(tokens, prompt_length)``, ordered by :func:`bucketed_order`."""

    def __init__(
        self,
        path: str | Path,
        *,
        tokenizer: Tokenizer,
        max_len: int,
        fields: InstructionFields = InstructionFields(),
        seed: int = 0,
        bucket_size: int = 1024,
        skip_bad_lines: bool = False,
    ) -> None:
        check_positive("max_len", max_len)
        check_positive("bucket_size", bucket_size)
        self.num_bad_lines = 0
        self.num_truncated = 0
        template = (
            chat_template(tokenizer, needed_by="data.messages_field")
            if fields.messages is not None
            else None
        )
        examples: list[tuple[list[int], int]] = []
        texts = converted_records(
            path,
            lambda record: _prompt_and_response(record, fields, template),
            skip_bad_lines=skip_bad_lines,
            bad_lines=self,
        )
        for prompt, response in texts:
            example = _tokenized(prompt, response, tokenizer, max_len, chat=template is not None)
            if example is None:
                self.num_truncated += 1
            else:
                examples.append(example)
        if not examples:
            raise TextDataError(f"{path} holds no example with a response within {max_len} tokens.")
        if self.num_truncated:
            log.warning(
                "%d examples of %s were left out: their prompt fills max_len (%d tokens).",
                self.num_truncated,
                path,
                max_len,
            )
        lengths = [len(tokens) for tokens, _ in examples]
        self._examples = [examples[i] for i in bucketed_order(lengths, seed, bucket_size)]

    def __len__(self) -> int:
        return len(self._examples)

    def __getitem__(self, index: int) -> tuple[list[int], int]:
        return self._examples[index]


def bucketed_order(lengths: Sequence[int], seed: int, bucket_size: int) -> list[int]:
    """A shuffle of the examples of ``lengths``, sorted by length within windows of
    ``bucket_size``."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    return [
        index
        for start in range(0, len(order), bucket_size)
        for index in sorted(order[start : start + bucket_size], key=lambda i: lengths[i])
    ]


def collate_instructions(examples: list[tuple[list[int], int]], *, pad_id: int) -> InstructionBatch:
    """Pad to the longest example; targets on the response only (the next token of each)."""
    length = max(len(tokens) for tokens, _ in examples) - 1
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.int64)
    target_ids = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.int64)
    for row, (tokens, prompt_len) in enumerate(examples):
        ids = torch.tensor(tokens, dtype=torch.int64)
        input_ids[row, : len(tokens) - 1] = ids[:-1]
        # Position p predicts token p + 1; the response starts at token prompt_len.
        target_ids[row, prompt_len - 1 : len(tokens) - 1] = ids[prompt_len:]
    num_targets = sum(len(tokens) - prompt_len for tokens, prompt_len in examples)
    return InstructionBatch(input_ids=input_ids, target_ids=target_ids, num_targets=num_targets)


class BadLineCounter(Protocol):
    num_bad_lines: int


RecordT = TypeVar("RecordT")


def converted_records(
    path: str | Path,
    convert: Callable[[Any], RecordT],
    *,
    skip_bad_lines: bool,
    bad_lines: BadLineCounter,
) -> Iterator[RecordT]:
    """``convert(record)`` of each record :func:`read_records` reads; a record that ``convert``
    refuses (a ``TextDataError``: a field missing or of the wrong type) is an error naming its
    file and line and the fix, or with ``skip_bad_lines`` counted in ``bad_lines.num_bad_lines``."""
    for where, record in read_records(path, skip_bad_lines=skip_bad_lines, bad_lines=bad_lines):
        try:
            converted = convert(record)
        except TextDataError as ex:
            if not skip_bad_lines:
                raise TextDataError(
                    f"{where}: {ex}. Fix the data, or set data.skip_bad_lines to skip and count "
                    "such records."
                ) from None
            bad_lines.num_bad_lines += 1
            continue
        yield converted


def read_records(path: str | Path, *, skip_bad_lines: bool, bad_lines: BadLineCounter) -> Any:
    """``(where, record)`` of each record of the JSONL and Parquet files of ``path``; a line
    that is not JSON is an error naming it, or with ``skip_bad_lines`` counted in
    ``bad_lines.num_bad_lines``."""
    for file in find_files(path):
        if file.format == "parquet":
            yield from _parquet_records(file.path)
            continue
        if file.format != "jsonl":
            raise TextDataError(
                f"{file.path}: examples must be JSONL (one a line) or Parquet, not plain text."
            )
        with open(file.path, encoding="utf-8", errors="strict") as stream:
            for line_nr, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as ex:
                    if not skip_bad_lines:
                        raise TextDataError(
                            f"{file.path}: line {line_nr}: the line is not JSON ({ex})"
                        ) from None
                    bad_lines.num_bad_lines += 1
                    continue
                yield f"{file.path}: line {line_nr}", record


def _parquet_records(path: str) -> Any:
    import pyarrow.parquet as pq

    row_nr = 0
    for batch in pq.ParquetFile(path).iter_batches():
        for record in batch.to_pylist():
            row_nr += 1
            yield f"{path}: row {row_nr}", record


def _prompt_and_response(record: Any, fields: InstructionFields, template: Any) -> tuple[str, str]:
    if not isinstance(record, dict):
        raise TextDataError(f"the record is a {type(record).__name__}, not a JSON object")
    if fields.messages is not None:
        return _render_chat(record, fields.messages, template)
    values = []
    for name in (fields.prompt, fields.response):
        value = record.get(name)
        if not isinstance(value, str):
            raise TextDataError(
                f"the record has no string field {name!r} (it has {sorted(record)}); set "
                "data.prompt_field and data.response_field"
            )
        values.append(value)
    return values[0], values[1]


def _render_chat(record: Mapping[str, Any], field: str, template: Any) -> tuple[str, str]:
    messages = chat_messages(record, field)
    if messages[-1]["role"] != "assistant":
        raise TextDataError("the last message must be the assistant's: it is the response")
    return render_chat(template, messages[:-1], messages[-1:])


def chat_messages(record: Mapping[str, Any], field: str) -> list[dict[str, Any]]:
    """The chat messages of ``record[field]``; a :class:`TextDataError` if it holds none."""
    messages = record.get(field)
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
    ):
        raise TextDataError(
            f"the field {field!r} must be a list of {{'role': ..., 'content': ...}} messages"
        )
    return messages


def render_chat(
    template: Any, prompt: list[dict[str, Any]], response: list[dict[str, Any]]
) -> tuple[str, str]:
    """The prompt's text (with the generation prompt) and the response's, the rest of the text
    the template renders for the whole conversation."""
    prompt_text = template.render(messages=prompt, add_generation_prompt=True)
    full = template.render(messages=prompt + response, add_generation_prompt=False)
    if not full.startswith(prompt_text):
        raise TextDataError("the chat template renders the conversation without its prompt first")
    return prompt_text, full[len(prompt_text) :]


def chat_template(tokenizer: Tokenizer, *, needed_by: str) -> Any:
    """The tokenizer's chat template (``tokenizer_config.json``), compiled in a sandbox."""
    config_path = (
        tokenizer.path.parent / "tokenizer_config.json"
        if isinstance(tokenizer, HuggingFaceTokenizer)
        else None
    )
    template = None
    if config_path is not None and config_path.is_file():
        config = json.loads(config_path.read_text())
        template = config.get("chat_template")
    if not isinstance(template, str):
        raise TextDataError(
            f"{needed_by} needs the tokenizer's chat template, but no tokenizer_config.json "
            "with a chat_template is beside the tokenizer. Give plain text fields instead, or "
            "add the template."
        )
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    specials = {
        "bos_token": _token_text(tokenizer, tokenizer.bos_id),
        "eos_token": _token_text(tokenizer, tokenizer.eos_id),
    }
    return environment.from_string(template, globals=specials)


def _token_text(tokenizer: Tokenizer, token_id: int | None) -> str:
    return "" if token_id is None else tokenizer.decode([token_id])


def _tokenized(
    prompt: str, response: str, tokenizer: Tokenizer, max_len: int, *, chat: bool
) -> tuple[list[int], int] | None:
    # A chat template writes BOS itself; a plain prompt gets one here.
    bos = [] if chat or tokenizer.bos_id is None else [tokenizer.bos_id]
    prompt_ids = bos + tokenizer.encode(prompt)
    tokens = (prompt_ids + tokenizer.encode(response) + [tokenizer.eos_id])[: max_len + 1]
    if len(tokens) <= len(prompt_ids):
        return None
    return tokens, len(prompt_ids)
