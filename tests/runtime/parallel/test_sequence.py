"""Sequence parallelism: the data split (runtime.data.sequence), the attention wrapper's checks
and refusals (runtime.parallel.sequence), and, from the shared two-rank launch, Ulysses
attention equal to one process's on both all-to-all paths and for Hugging Face's sdpa and
eager attention. The whole runs are in tests/recipes/test_lm_sequence_parallel.py."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from models.llama import Llama, LlamaArgs
from runtime.data.data_reader import DataReader
from runtime.data.sequence import SequenceSplitReader, split_sequences
from runtime.data.text.instructions import collate_instructions
from runtime.data.text.packing import TextBatch, batch_of
from runtime.parallel.sequence import (
    SequenceParallelError,
    check_model,
    check_sequence_length,
    repeat_kv_for,
)
from units.lm import IGNORE_INDEX


def packed_batch() -> TextBatch:
    tokens = torch.arange(2 * 9).reshape(2, 9)
    return batch_of(tokens, document_starts=([0, 1], [3, 5]))


def test_each_sp_rank_keeps_its_positions_with_global_positions_and_whole_documents() -> None:
    batch = packed_batch()
    parts = [split_sequences(batch, rank, 2) for rank in range(2)]
    assert torch.equal(torch.cat([p.input_ids for p in parts], 1), batch.input_ids)
    # Targets were shifted before the split: the first rank's last target is the next rank's
    # first input.
    assert torch.equal(torch.cat([p.target_ids for p in parts], 1), batch.target_ids)
    assert parts[0].target_ids[0, -1] == parts[1].input_ids[0, 0]
    assert batch.positions is not None
    assert torch.equal(torch.cat([p.positions for p in parts], 1), batch.positions)  # type: ignore[misc]
    for part in parts:
        assert part.document_ids is batch.document_ids  # attention sees the whole sequence
        assert part.num_targets == 8
    assert split_sequences(batch, 0, 1) is batch


def test_a_batch_without_positions_gets_global_ones() -> None:
    batch = batch_of(torch.arange(9).reshape(1, 9), document_starts=None)
    part = split_sequences(batch, 1, 4)
    assert part.positions is not None
    assert part.positions.tolist() == [[2, 3]]
    assert part.input_ids.tolist() == [[2, 3]]


def test_sft_batches_are_padded_to_split_and_count_each_rank_s_targets() -> None:
    # Prompts of 3 and 2 tokens; 7 positions, padded to 8 for two ranks.
    batch = collate_instructions([([5, 6, 7, 8, 9, 10, 11, 12], 3), ([5, 6, 7, 8], 2)], pad_id=0)
    assert batch.input_ids.shape == (2, 7)
    parts = [split_sequences(batch, rank, 2) for rank in range(2)]
    assert [p.input_ids.shape for p in parts] == [(2, 4), (2, 4)]
    assert sum(p.num_targets for p in parts) == batch.num_targets == 7
    assert parts[0].num_targets == 2 + 2
    assert parts[1].target_ids[:, -1].tolist() == [IGNORE_INDEX, IGNORE_INDEX]
    assert torch.equal(torch.cat([p.target_ids for p in parts], 1)[:, :7], batch.target_ids)


def test_a_packed_batch_that_does_not_split_is_refused() -> None:
    with pytest.raises(ValueError, match="does not split over sp_size 3"):
        split_sequences(packed_batch(), 0, 3)
    with pytest.raises(TypeError, match="splits dataclass batches"):
        split_sequences({"input_ids": torch.zeros(1, 4)}, 0, 2)


class _ListReader(DataReader[TextBatch]):
    """One step of two packed micro-batches a data epoch."""

    def __init__(self) -> None:
        self.position = 0

    def __next__(self) -> list[TextBatch]:
        if self.position:
            raise StopIteration
        self.position = 1
        return [packed_batch(), packed_batch()]

    def reset(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, object]:
        return {"position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.position = state["position"]

    @property
    def num_accumulate(self) -> int:
        return 2


def test_the_reader_wrapper_splits_every_micro_batch_and_passes_the_rest_through() -> None:
    split = SequenceSplitReader(_ListReader(), _FakeSp(rank=1, size=2))  # type: ignore[arg-type]
    assert split.num_accumulate == 2
    first, second = next(split)
    assert first.input_ids.tolist() == [[4, 5, 6, 7], [13, 14, 15, 16]]
    assert second.num_targets == 8
    assert split.state_dict() == {"position": 1}
    with pytest.raises(StopIteration):
        next(split)
    split.load_state_dict({"position": 0})
    assert len(next(split)) == 2
    assert isinstance(split.for_evaluation(), SequenceSplitReader)
    assert split.position == 1  # the wrapped reader's own attributes stay reachable


class _FakeSp:
    """What SequenceSplitReader reads of a gang."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def test_refusals_are_one_line_and_say_what_works() -> None:
    with pytest.raises(SequenceParallelError, match=r"Use a seq_len .* \(e.g. 28 or 32\)"):
        check_sequence_length(30, 4)
    llama = Llama(
        LlamaArgs(vocab_size=10, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, ffn_dim=8)
    )
    assert check_model(llama, 2, 2) == "llama"
    with pytest.raises(
        SequenceParallelError, match=r"4 attention heads do not split over sp_size 8"
    ) as error:
        check_model(llama, 8, 1)
    assert "\n" not in str(error.value)
    with pytest.raises(SequenceParallelError, match="With tp_size 2, use sp_size 1 or 2"):
        check_model(llama, 4, 2)
    with pytest.raises(SequenceParallelError, match="cannot wrap the attention of Linear"):
        check_model(nn.Linear(2, 2), 2, 1)


def test_a_hugging_face_model_with_another_attention_is_refused() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=1,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config)
    assert check_model(model, 4, 1) == "sdpa"
    config._attn_implementation = "flex_attention"
    with pytest.raises(SequenceParallelError, match=r"uses 'flex_attention'\. Load it with"):
        check_model(model, 2, 1)


def test_gpt2_attention_is_wrapped_though_it_has_no_key_value_groups() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=10, n_embd=16, n_layer=1, n_head=4)
    config._attn_implementation = "sdpa"
    assert check_model(transformers.GPT2LMHeadModel(config), 4, 1) == "sdpa"


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("Mistral", {}),
        ("Qwen2", {"use_sliding_window": True, "layer_types": ["sliding_attention"]}),
    ],
)
def test_a_hugging_face_model_with_sliding_windows_is_refused(
    family: str, options: dict[str, object]
) -> None:
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, f"{family}Config")(
        vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=1, sliding_window=16, **options,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    with pytest.raises(SequenceParallelError, match="within a sliding window of 16 tokens"):
        check_model(model, 2, 1)
    with pytest.raises(
        SequenceParallelError, match=r"16 tokens, shorter than data.seq_len \(32\)\. .* at most 16"
    ):
        check_model(model, 2, 1, seq_len=32)
    # A window as long as the sequence masks nothing.
    assert check_model(model, 2, 1, seq_len=16) == "sdpa"
    if family == "Qwen2":  # windows configured but used by no layer
        config.layer_types = ["full_attention"]
        assert check_model(transformers.Qwen2ForCausalLM(config), 2, 1) == "sdpa"


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "factor"),
    [(4, 2, 2, 1), (4, 1, 2, 2), (8, 2, 4, 2), (8, 1, 8, 8), (6, 3, 2, 2)],
)
def test_key_value_heads_repeat_until_the_sp_ranks_divide_them(
    heads: int, kv_heads: int, size: int, factor: int
) -> None:
    assert repeat_kv_for(heads, kv_heads, size) == factor


PATHS = ("private", "public")


@pytest.mark.distributed
def test_ulysses_attention_equals_one_process_forward_and_backward(
    two_rank_checks: Path,
) -> None:
    for rank in range(2):
        diffs = json.loads(
            (two_rank_checks / "sequence_parallel" / f"rank_{rank}.json").read_text()
        )
        assert set(diffs) == {
            "attention_private",
            "attention_private_masked",
            "attention_public",
            "attention_public_masked",
            "hf_sdpa",
            "hf_eager",
        }
        # Both all-to-all paths move the same bits; one key/value head, repeated in two
        # steps instead of one, sums its gradient in another order.
        for case in ("attention", "attention_masked"):
            private, public = (case.replace("attention", f"attention_{p}") for p in PATHS)
            assert diffs[private] == diffs[public] < 1e-6, diffs
        assert diffs["hf_sdpa"] < 1e-5 and diffs["hf_eager"] < 1e-5, diffs
