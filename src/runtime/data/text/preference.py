"""Preference data: a prompt with a chosen and a rejected completion, for DPO and its kin.

A record (JSONL or Parquet, as the instruction data reads them) holds ``prompt``, ``chosen`` and
``rejected``: plain strings, or chat messages (TRL's conversational format: ``prompt`` a list of
``{"role", "content"}`` messages, ``chosen`` and ``rejected`` lists of the assistant's messages, or
strings taken as one assistant message) rendered with the tokenizer's chat template.

Tokens, as TRL's ``DPOTrainer`` makes them: plain text becomes ``[BOS] prompt`` and
``completion [EOS]`` (BOS where the tokenizer has one); chat text is the template's prompt with
its generation prompt, then the rest of the conversation's text, which the template ends itself.
Each sequence ``prompt + completion`` is cut to ``max_len`` tokens from its end (TRL's
``max_length`` with ``truncation_mode="keep_start"``). A pair whose prompt alone fills
``max_len`` has no completion token left: it is left out and counted (``num_dropped``); a pair
whose completion was cut is kept and counted (``num_truncated``). Both counts are logged.

Order: shuffled once by ``seed``, then sorted by length in windows of ``bucket_size`` pairs
(:func:`~runtime.data.text.instructions.bucketed_order`); read it with
``MapDataReader(shuffle=False)``.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, final

import torch
from torch import Tensor

from runtime.data.text.files import TextDataError
from runtime.data.text.instructions import (
    bucketed_order,
    chat_messages,
    chat_template,
    converted_records,
    render_chat,
)
from runtime.data.text.tokenizer import Tokenizer
from trainkit_utils.arguments import check_positive
from units.lm import IGNORE_INDEX

log = logging.getLogger(__name__)


@final
@dataclass(frozen=True)
class PreferenceFields:
    """The record fields of the prompt and of the chosen and rejected completions."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"


class PreferencePair(NamedTuple):
    """One tokenized pair, truncated: the prompt and each completion; ``pair_id``, its position
    in its dataset (what precomputed reference log-probabilities are looked up by)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    pair_id: int = -1


@final
@dataclass
class PreferenceBatch:
    """``num_pairs`` pairs as ``2 * num_pairs`` rows: the chosen sequences, then the rejected
    ones (TRL's layout), right-padded. ``target_ids`` is the next token on completion positions
    and ``IGNORE_INDEX`` elsewhere, so a row's completion log-probability is the sum over its
    targets."""

    input_ids: Tensor  # [2 * num_pairs, length], int64
    target_ids: Tensor  # [2 * num_pairs, length], int64
    num_pairs: int
    num_bad_lines: int = 0
    num_dropped: int = 0
    pair_ids: Tensor | None = None  # [num_pairs], int64: each pair's index in its dataset

    @property
    def batch_size(self) -> int:
        return self.num_pairs


@final
class PreferenceDataset(torch.utils.data.Dataset[PreferencePair]):
    """The tokenized pairs of ``path`` (JSONL or Parquet files, a directory or a glob)."""

    def __init__(
        self,
        path: str | Path,
        *,
        tokenizer: Tokenizer,
        max_len: int,
        fields: PreferenceFields = PreferenceFields(),
        seed: int = 0,
        bucket_size: int = 1024,
        skip_bad_lines: bool = False,
    ) -> None:
        check_positive("max_len", max_len)
        check_positive("bucket_size", bucket_size)
        self.num_bad_lines = 0
        self.num_dropped = 0
        self.num_truncated = 0
        self._tokenizer, self._max_len, self._template = tokenizer, max_len, None
        pairs: list[PreferencePair] = []
        tokenized = converted_records(
            path,
            lambda record: self._tokenized(*self._texts(record, fields)),
            skip_bad_lines=skip_bad_lines,
            bad_lines=self,
        )
        for pair in tokenized:
            if pair is None:
                self.num_dropped += 1
            else:
                pairs.append(pair)
        self._log_counts(path, len(pairs))
        lengths = [len(p.prompt) + max(len(p.chosen), len(p.rejected)) for p in pairs]
        order = bucketed_order(lengths, seed, bucket_size)
        self._pairs = [pairs[i]._replace(pair_id=pair_id) for pair_id, i in enumerate(order)]

    def __len__(self) -> int:
        return len(self._pairs)

    def __getitem__(self, index: int) -> PreferencePair:
        return self._pairs[index]

    def fingerprint(self) -> str:
        """A digest of every pair's tokens, in order: what precomputed values were made for."""
        digest = hashlib.sha256()
        for pair in self._pairs:
            for ids in (pair.prompt, pair.chosen, pair.rejected):
                digest.update(array("q", [len(ids), *ids]).tobytes())
        return digest.hexdigest()

    def _texts(self, record: Any, fields: PreferenceFields) -> tuple[str, str, str, bool]:
        """The prompt's, chosen's and rejected's text, and whether they came from a chat."""
        if not isinstance(record, dict):
            raise TextDataError(f"the record is a {type(record).__name__}, not a JSON object")
        missing = [
            name for name in (fields.prompt, fields.chosen, fields.rejected) if name not in record
        ]
        if missing:
            raise TextDataError(
                f"the record has no field {missing[0]!r} (it has {sorted(record)}); set "
                "preference.prompt_field, preference.chosen_field and preference.rejected_field"
            )
        prompt = record[fields.prompt]
        if isinstance(prompt, list):
            return self._chat_texts(record, fields)
        texts = [record[name] for name in (fields.prompt, fields.chosen, fields.rejected)]
        for name, text in zip((fields.prompt, fields.chosen, fields.rejected), texts, strict=True):
            if not isinstance(text, str):
                raise TextDataError(
                    f"the field {name!r} is {type(text).__name__}: give strings, or chat "
                    "messages with the prompt a list of messages"
                )
        return texts[0], texts[1], texts[2], False

    def _chat_texts(
        self, record: Mapping[str, Any], fields: PreferenceFields
    ) -> tuple[str, str, str, bool]:
        if self._template is None:
            self._template = chat_template(
                self._tokenizer, needed_by="Chat-message preference data"
            )
        prompt = chat_messages(record, fields.prompt)
        completions = []
        for name in (fields.chosen, fields.rejected):
            value = record[name]
            messages = (
                [{"role": "assistant", "content": value}]
                if isinstance(value, str)
                else chat_messages(record, name)
            )
            completions.append(render_chat(self._template, prompt, messages))
        prompt_text = completions[0][0]
        return prompt_text, completions[0][1], completions[1][1], True

    def _tokenized(
        self, prompt: str, chosen: str, rejected: str, chat: bool
    ) -> PreferencePair | None:
        tokenizer, max_len = self._tokenizer, self._max_len
        # A chat template writes BOS and ends each turn itself.
        bos = [] if chat or tokenizer.bos_id is None else [tokenizer.bos_id]
        eos = [] if chat else [tokenizer.eos_id]
        prompt_ids = bos + tokenizer.encode(prompt)
        if not prompt_ids:
            # The first completion token would have no position to predict it from.
            raise TextDataError("the prompt has no token, and the tokenizer no BOS to start it")
        if len(prompt_ids) >= max_len:
            return None
        room = max_len - len(prompt_ids)
        chosen_ids, rejected_ids = (tokenizer.encode(text) + eos for text in (chosen, rejected))
        if len(chosen_ids) > room or len(rejected_ids) > room:
            self.num_truncated += 1
        return PreferencePair(prompt_ids, chosen_ids[:room], rejected_ids[:room])

    def _log_counts(self, path: str | Path, num_pairs: int) -> None:
        if num_pairs == 0:
            raise TextDataError(
                f"{path} holds no preference pair whose prompt is shorter than {self._max_len} "
                f"tokens ({self.num_dropped} left out, {self.num_bad_lines} unreadable). Raise "
                "data.seq_len, or give shorter prompts."
            )
        if self.num_dropped:
            log.warning(
                "%d of the %d pairs of %s were left out: their prompt fills max_len (%d tokens).",
                self.num_dropped,
                num_pairs + self.num_dropped,
                path,
                self._max_len,
            )
        if self.num_truncated:
            log.warning(
                "%d pairs of %s have a completion cut to fit max_len (%d tokens, keep_start).",
                self.num_truncated,
                path,
                self._max_len,
            )


def collate_preference_pairs(
    pairs: list[PreferencePair], *, pad_id: int, num_bad_lines: int = 0, num_dropped: int = 0
) -> PreferenceBatch:
    """The chosen rows, then the rejected rows, each ``prompt + completion`` right-padded with
    ``pad_id`` to the longest; targets on the completion tokens only."""
    rows = [(p.prompt, p.chosen) for p in pairs] + [(p.prompt, p.rejected) for p in pairs]
    length = max(len(prompt) + len(completion) for prompt, completion in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.int64)
    target_ids = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.int64)
    for row, (prompt, completion) in enumerate(rows):
        ids = torch.tensor(prompt + completion, dtype=torch.int64)
        input_ids[row, : len(ids)] = ids
        # Position p predicts token p + 1; the completion starts at token len(prompt).
        target_ids[row, len(prompt) - 1 : len(ids) - 1] = ids[len(prompt) :]
    return PreferenceBatch(
        input_ids=input_ids,
        target_ids=target_ids,
        num_pairs=len(pairs),
        num_bad_lines=num_bad_lines,
        num_dropped=num_dropped,
        pair_ids=torch.tensor([p.pair_id for p in pairs], dtype=torch.int64),
    )
