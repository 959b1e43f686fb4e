"""The preference units against TRL (a test-only dependency): the same tiny Llama from a config,
the same tokenizer and pairs, float32 on the CPU. The losses and every metric agree within 1e-5
at each of a few steps, and so do the weights after the optimizer steps.

DPO goes through TRL's own data path (``DPOTrainer``'s tokenization and collator, truncation
included) and its ``compute_loss``; SimPO (``CPOTrainer``, ``loss_type="simpo"``) and ORPO
(``ORPOTrainer``) get this runtime's batches in their batch format, to their
``get_batch_loss_metrics``.
"""

from __future__ import annotations

import copy
import json
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.data.text import (
    IGNORE_INDEX,
    PreferenceBatch,
    PreferenceDataset,
    collate_preference_pairs,
    load_tokenizer,
)
from tests.conftest import WORDS, make_tokenizer_dir
from units.preference import (
    CpoTrainUnit,
    DpoTrainUnit,
    OrpoTrainUnit,
    PreferenceOptions,
    PreferenceTrainUnit,
    SimpoTrainUnit,
    whole_sequence_targets,
)
from units.reference import FrozenReference

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

BATCH_SIZE = 3
NUM_STEPS = 3
MAX_LEN = 14
LR = 1e-3
TOLERANCE = 1e-5


def phrase(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def write_pairs(path: Path, count: int, *, even: bool = False) -> list[dict[str, str]]:
    """Pairs of uneven lengths, some too long for MAX_LEN (cut) and one whose prompt fills it
    (left out); ``even``: every prompt 4 words long, every chosen completion 3."""
    rng = random.Random(3)
    chosen_len = 3 if even else None
    records = [
        {
            "prompt": phrase(rng, 4, 4) if even else phrase(rng, 2, 6),
            # TRL joins prompt and completion as they are: a completion starts with its space.
            "chosen": " " + phrase(rng, chosen_len or 1, chosen_len or 9),
            "rejected": " " + phrase(rng, 1, 9),
        }
        for _ in range(count)
    ]
    records.append({"prompt": phrase(rng, MAX_LEN, MAX_LEN), "chosen": "a", "rejected": "the"})
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return records


def make_bos_tokenizer(directory: Path) -> Any:
    """The word-level test tokenizer, with a post-processor that starts a text with <s> as
    Llama's does: what TRL's tokenization gets, and this runtime adds itself."""
    from tokenizers import Tokenizer, processors

    make_tokenizer_dir(directory, [" ".join(WORDS)])
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
    )


def tiny_llama(vocab_size: int) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def our_batches(path: Path, directory: Path, *, cuts: bool = True) -> list[PreferenceBatch]:
    dataset = PreferenceDataset(path, tokenizer=load_tokenizer(directory), max_len=MAX_LEN)
    assert dataset.num_dropped == 1 and (dataset.num_truncated > 0) == cuts
    pairs = [dataset[i] for i in range(NUM_STEPS * BATCH_SIZE)]
    return [
        collate_preference_pairs(pairs[i : i + BATCH_SIZE], pad_id=2)
        for i in range(0, len(pairs), BATCH_SIZE)
    ]


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.01)


def train_ours(unit: PreferenceTrainUnit, batches: list[PreferenceBatch]) -> list[dict[str, float]]:
    """The unit's loss (sum over pairs / pairs, as the Trainer normalizes it) and metrics at
    each step, before its optimizer step."""
    optimizer = adamw(unit.model)
    steps = []
    for batch in batches:
        loss, num_pairs = unit(batch)
        assert num_pairs == batch.num_pairs
        (loss / num_pairs).backward()
        optimizer.step()
        optimizer.zero_grad()
        metrics = unit.metric_bag.sync_and_compute(_single_gang())
        steps.append({"loss": loss.item() / num_pairs, **metrics})
        unit.metric_bag.reset_non_persistent_metrics()
    return steps


def train_trl(
    model: torch.nn.Module,
    batches: list[Any],
    loss_and_metrics: Callable[[Any], tuple[torch.Tensor, dict[str, float]]],
) -> list[dict[str, float]]:
    optimizer = adamw(model)
    steps = []
    for batch in batches:
        loss, metrics = loss_and_metrics(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        steps.append({"loss": loss.item(), **metrics})
    return steps


def _single_gang() -> Any:
    from gangs import FakeGang

    return FakeGang()


def assert_agree(ours: list[dict[str, float]], theirs: list[dict[str, float]], names: list[str]):
    for step, (mine, trl_step) in enumerate(zip(ours, theirs, strict=True)):
        for name in names:
            assert mine[name] == pytest.approx(trl_step[name], abs=TOLERANCE), (step, name)


def assert_same_weights(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    theirs_state = theirs.state_dict()
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(tensor, theirs_state[name], atol=TOLERANCE, rtol=0)


def trl_args(config_class: Any, tmp_path: Path, **options: Any) -> Any:
    return config_class(
        output_dir=str(tmp_path / "trl"),
        report_to=[],
        use_cpu=True,
        # TRL's configs default to bf16 where the machine has it, the CPU included: the
        # reference, prepared apart, then runs under bf16 autocast and the rewards of step 0
        # are not 0. The comparison is in float32.
        bf16=False,
        per_device_train_batch_size=BATCH_SIZE,
        dataset_num_proc=None,
        **options,
    )


METRICS = [
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
]


@pytest.mark.parametrize(
    ("loss_type", "label_smoothing"),
    [("sigmoid", 0.0), ("hinge", 0.0), ("ipo", 0.0), ("robust", 0.2)],
)
def test_dpo_matches_trl_dpo_trainer(
    tmp_path: Path, loss_type: str, label_smoothing: float
) -> None:
    records = write_pairs(tmp_path / "pairs.jsonl", 12)
    hf_tokenizer = make_bos_tokenizer(tmp_path / "tok")
    batches = our_batches(tmp_path / "pairs.jsonl", tmp_path / "tok")
    policy = tiny_llama(hf_tokenizer.vocab_size)
    models = [copy.deepcopy(policy) for _ in range(3)]
    options = PreferenceOptions(beta=0.5, loss_type=loss_type, label_smoothing=label_smoothing)  # type: ignore[arg-type]
    unit = DpoTrainUnit(models[0], FrozenReference(models[1].requires_grad_(False)), options)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.DPOTrainer(
            model=policy,
            ref_model=models[2],
            args=trl_args(
                trl.DPOConfig,
                tmp_path,
                beta=0.5,
                loss_type=[loss_type],
                label_smoothing=label_smoothing,
                max_length=MAX_LEN,
            ),
            train_dataset=datasets.Dataset.from_list(records),
            processing_class=hf_tokenizer,
        )
    # TRL's tokenized pairs, in this runtime's order: the same tokens, the same pair left out.
    rows = {
        (tuple(r["prompt_ids"]), tuple(r["chosen_ids"][: MAX_LEN - len(r["prompt_ids"])])): r
        for r in trainer.train_dataset
    }
    assert len(rows) == len(records) - 1
    trl_batches = []
    for batch in batches:
        chosen_rows = _rows_of(batch)[: batch.num_pairs]
        examples = [rows[key] for key in chosen_rows]
        collated = trainer.data_collator(examples)
        assert torch.equal(collated["input_ids"], batch.input_ids)
        assert torch.equal(
            collated["completion_mask"][:, 1:].bool(), (batch.target_ids != IGNORE_INDEX)[:, :-1]
        )
        trl_batches.append(collated)

    def trl_step(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        trainer._metrics["train"].clear()
        loss = trainer.compute_loss(policy, inputs)
        return loss, {name: values[-1] for name, values in trainer._metrics["train"].items()}

    theirs = train_trl(policy, trl_batches, trl_step)
    ours = train_ours(unit, batches)
    assert ours[0]["rewards/chosen"] == 0.0 and ours[0]["rewards/margins"] == 0.0
    assert_agree(ours, theirs, METRICS)
    assert_same_weights(models[0], policy)


def _rows_of(batch: PreferenceBatch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each row's prompt and completion tokens, from its input ids and targets."""
    keys = []
    for ids, targets in zip(batch.input_ids.tolist(), batch.target_ids.tolist(), strict=True):
        first = next(i for i, t in enumerate(targets) if t != IGNORE_INDEX)
        last = max(i for i, t in enumerate(targets) if t != IGNORE_INDEX)
        keys.append((tuple(ids[: first + 1]), tuple(ids[first + 1 : last + 2])))
    return keys


def cpo_style_batch(batch: PreferenceBatch) -> dict[str, torch.Tensor]:
    """This runtime's batch in the format of TRL's CPO and ORPO trainers: each row's tokens, and
    labels that are the tokens on the completion (the trainers shift them)."""
    n = batch.num_pairs
    labels = torch.full_like(batch.input_ids, IGNORE_INDEX)
    labels[:, 1:] = batch.target_ids[:, :-1]
    # The row's own tokens: the first, and each that a real position predicts.
    mask = torch.ones_like(batch.input_ids)
    mask[:, 1:] = (whole_sequence_targets(batch) != IGNORE_INDEX)[:, :-1].long()
    return {
        "chosen_input_ids": batch.input_ids[:n],
        "chosen_attention_mask": mask[:n],
        "chosen_labels": labels[:n],
        "rejected_input_ids": batch.input_ids[n:],
        "rejected_attention_mask": mask[n:],
        "rejected_labels": labels[n:],
    }


def _reference_free_trainer(
    trainer_class: Any, config: Any, model: Any, tokenizer: Any, records: list[dict[str, str]]
) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_class(
            model=model,
            args=config,
            train_dataset=datasets.Dataset.from_list(records[:2]),
            processing_class=tokenizer,
        )


def test_simpo_matches_trl_cpo_trainer_with_loss_type_simpo(tmp_path: Path) -> None:
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    records = write_pairs(tmp_path / "pairs.jsonl", 12)
    hf_tokenizer = make_bos_tokenizer(tmp_path / "tok")
    batches = our_batches(tmp_path / "pairs.jsonl", tmp_path / "tok")
    policy = tiny_llama(hf_tokenizer.vocab_size)
    mine = copy.deepcopy(policy)
    config = trl_args(
        CPOConfig,
        tmp_path,
        loss_type="simpo",
        cpo_alpha=0.0,
        beta=2.0,
        simpo_gamma=0.7,
        label_smoothing=0.1,
    )
    trainer = _reference_free_trainer(CPOTrainer, config, policy, hf_tokenizer, records)
    unit = SimpoTrainUnit(mine, PreferenceOptions(beta=2.0, simpo_gamma=0.7, label_smoothing=0.1))

    theirs = train_trl(
        policy,
        [cpo_style_batch(b) for b in batches],
        lambda batch: trainer.get_batch_loss_metrics(policy, batch),
    )
    ours = train_ours(unit, batches)
    assert_agree(ours, theirs, METRICS)
    assert_same_weights(mine, policy)


def test_orpo_matches_trl_orpo_trainer(tmp_path: Path) -> None:
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    # TRL's NLL term is the mean over the tokens of the batch's chosen sequences, this
    # runtime's the mean over pairs of each sequence's (a sum over pairs): equal lengths agree.
    records = write_pairs(tmp_path / "pairs.jsonl", 12, even=True)
    hf_tokenizer = make_bos_tokenizer(tmp_path / "tok")
    batches = our_batches(tmp_path / "pairs.jsonl", tmp_path / "tok", cuts=False)
    policy = tiny_llama(hf_tokenizer.vocab_size)
    mine = copy.deepcopy(policy)
    config = trl_args(ORPOConfig, tmp_path, beta=0.3)
    trainer = _reference_free_trainer(ORPOTrainer, config, policy, hf_tokenizer, records)
    unit = OrpoTrainUnit(mine, PreferenceOptions(beta=0.3))

    theirs = train_trl(
        policy,
        [cpo_style_batch(b) for b in batches],
        lambda batch: trainer.get_batch_loss_metrics(policy, batch),
    )
    ours = train_ours(unit, batches)
    assert_agree(ours, theirs, [*METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen"])
    assert_same_weights(mine, policy)


def test_cpo_matches_trl_cpo_trainer(tmp_path: Path) -> None:
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    # TRL's NLL term is the mean over the tokens of the batch's chosen completions, this
    # runtime's the mean over pairs of each completion's: equal lengths agree.
    records = write_pairs(tmp_path / "pairs.jsonl", 12, even=True)
    hf_tokenizer = make_bos_tokenizer(tmp_path / "tok")
    batches = our_batches(tmp_path / "pairs.jsonl", tmp_path / "tok", cuts=False)
    policy = tiny_llama(hf_tokenizer.vocab_size)
    mine = copy.deepcopy(policy)
    options = {"beta": 0.2, "label_smoothing": 0.1, "cpo_alpha": 0.7}
    config = trl_args(CPOConfig, tmp_path, loss_type="sigmoid", **options)
    trainer = _reference_free_trainer(CPOTrainer, config, policy, hf_tokenizer, records)
    unit = CpoTrainUnit(mine, PreferenceOptions(**options))

    theirs = train_trl(
        policy,
        [cpo_style_batch(b) for b in batches],
        lambda batch: trainer.get_batch_loss_metrics(policy, batch),
    )
    ours = train_ours(unit, batches)
    assert_agree(ours, theirs, [*METRICS, "nll_loss"])
    assert_same_weights(mine, policy)
