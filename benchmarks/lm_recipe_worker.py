"""One process of the LM recipe's comparisons: a Hugging Face Llama trained on JSONL text.

``python -m benchmarks.lm_recipe_worker --feed text|tensors --loop recipe|hand [--quick]``.

- ``--feed text``: the recipe's data path, ``TextDataReader`` tokenizing JSONL documents in two
  worker processes with a BPE tokenizer; ``--feed tensors``: the same number of tokens a step,
  already tokenized, sliced from a tensor by ``MapDataReader``.
- ``--loop recipe``: the recipe's unit (``units.lm.LMTrainUnit``) in the Trainer; ``--loop
  hand``: the loop a user writes over the same model and pre-tokenized batches.

Prints ``BENCH_RESULT {"step_time_s": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchmarks.loops.trainer_loop import StepClock
from benchmarks.probe import StepTimer, emit, exit_now, use_one_thread
from checkpoint import CheckpointManager
from gangs import setup_gangs
from runtime import MapDataReader, Trainer
from runtime.data.text import HuggingFaceTokenizer, TextBatch, TextDataReader
from units.lm import LMTrainUnit, summed_nll_loss

SEQ_LEN = 256
BATCH_SIZE = 4
WORDS = [f"w{i}x{i * 7 % 13}" for i in range(3000)]


def make_corpus(directory: Path, num_documents: int) -> tuple[Path, HuggingFaceTokenizer]:
    """JSONL documents of random words and a BPE tokenizer trained on them, made here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = random.Random(0)
    documents = [
        " ".join(rng.choices(WORDS, k=rng.randint(200, 800))) for _ in range(num_documents)
    ]
    corpus = directory / "train.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(documents[:200], trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return corpus, HuggingFaceTokenizer(directory)


def make_model(vocab_size: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


class Windows(torch.utils.data.Dataset[TextBatch]):
    def __init__(self, tokens: Tensor) -> None:
        self._tokens = tokens

    def __len__(self) -> int:
        return (self._tokens.numel() - 1) // (SEQ_LEN + 1)

    def __getitem__(self, index: int) -> Tensor:
        start = index * (SEQ_LEN + 1)
        return self._tokens[start : start + SEQ_LEN + 1]


def collate(rows: list[Tensor]) -> TextBatch:
    stacked = torch.stack(rows)
    return TextBatch(
        input_ids=stacked[:, :-1], target_ids=stacked[:, 1:], num_targets=stacked[:, 1:].numel()
    )


def tokenized(corpus: Path, tokenizer: HuggingFaceTokenizer) -> Tensor:
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    ids = [token for ids in tokenizer.encode_batch(texts) for token in [*ids, tokenizer.eos_id]]
    return torch.tensor(ids, dtype=torch.int64)


def run_trainer(model: torch.nn.Module, reader: Any, timer: StepTimer, steps: int) -> None:
    gangs = setup_gangs(tp_size=1)
    scratch = Path(os.environ["BENCH_SCRATCH"])
    Trainer(
        unit=LMTrainUnit(model),
        data_reader=reader,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        checkpoint_manager=CheckpointManager(scratch / "checkpoints", gangs),
        gangs=gangs,
        max_num_steps=steps,
        max_gradient_norm=1.0,
        publish_metrics_every_n_steps=steps,
        callbacks=[StepClock(timer)],
        progress=False,
    ).run()


def run_hand(model: torch.nn.Module, tokens: Tensor, timer: StepTimer, steps: int) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    windows = Windows(tokens)
    for step_nr in range(steps):
        first = step_nr * BATCH_SIZE % (len(windows) - BATCH_SIZE)
        batch = collate([windows[i] for i in range(first, first + BATCH_SIZE)])
        logits = model(input_ids=batch.input_ids, use_cache=False).logits
        loss = summed_nll_loss(logits, batch.target_ids)
        (loss / batch.num_targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.step_end()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--feed", choices=("text", "tensors"), required=True)
    parser.add_argument("--loop", choices=("recipe", "hand"), required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    use_one_thread()
    steps, warmup = (12, 4) if args.quick else (60, 10)
    scratch = Path(os.environ["BENCH_SCRATCH"])
    corpus, tokenizer = make_corpus(scratch, num_documents=120 if args.quick else 500)
    model = make_model(tokenizer.vocab_size)
    timer = StepTimer(num_warmup=warmup, num_steps=steps)
    if args.loop == "hand":
        run_hand(model, tokenized(corpus, tokenizer), timer, steps)
    elif args.feed == "text":
        reader = TextDataReader(
            sources=corpus,
            tokenizer=tokenizer,
            seq_len=SEQ_LEN,
            batch_size=BATCH_SIZE,
            gang=setup_gangs(tp_size=1).dp,
            num_workers=2,
        )
        run_trainer(model, reader, timer, steps)
        reader.close()
    else:
        reader = MapDataReader(
            dataset=Windows(tokenized(corpus, tokenizer)),
            batch_size=BATCH_SIZE,
            collate=collate,
            gang=setup_gangs(tp_size=1).dp,
        )
        run_trainer(model, reader, timer, steps)
    emit({"step_time_s": timer.seconds_per_step()})
    exit_now()


if __name__ == "__main__":
    main()
