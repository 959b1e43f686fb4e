"""A tiny Hugging Face Llama, built on meta and sharded over its decoder layers, validated or
evaluated before it trains, for tests/runtime/training/test_validation.py.

Usage: ``hf_validation.py OUTPUT_DIR JSON_OPTIONS``. Options: ``data_parallel`` (``fsdp`` or
``hsdp``), ``dp_shard_size`` (HSDP), and ``first``: ``validate`` (``validate_at_start=True``)
or ``evaluate`` (an :class:`Evaluator` run, then the training, in this process). Rank 0 writes
``result.json``: ``{"steps": the steps trained, "evaluated": [run, step] of each evaluation,
"grad_norms": one per step}``. With ``{"runs": {NAME: OPTIONS, ...}}`` (one DP layout) it makes
each run in turn in one launch (one torchrun start-up), into ``OUTPUT_DIR/NAME``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset
from torcheval.metrics import Mean
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from checkpoint import CheckpointManager
from gangs import Gangs, setup_gangs
from runtime import Evaluator, MapDataReader, Trainer, apply_data_parallel, materialize_model
from tests.conftest import ListRecorder
from tests.workers.leave import leave
from units import EvalUnit, TrainUnit

SEQ_LEN = 8
VOCAB = 64


def build_llama(options: dict[str, Any], gangs: Any) -> nn.Module:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = apply_data_parallel(
        model, gangs, kind=options["data_parallel"], fsdp_units=(LlamaDecoderLayer,)
    )

    def init_fn(name: str, module: nn.Module) -> None:
        if isinstance(module, LlamaRMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, LlamaRotaryEmbedding):
            # Its buffers are computed, not drawn: copy them from one built on the CPU.
            fresh = LlamaRotaryEmbedding(module.config)
            for buffer_name, buffer in fresh.named_buffers():
                module.get_buffer(buffer_name).copy_(buffer)
        else:
            module.reset_parameters()  # type: ignore[operator]

    materialize_model(model, device=gangs.root.device, seed=3, init_fn=init_fn)
    return model


def next_token_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return nn.functional.cross_entropy(
        logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum"
    )


class LlamaTrainUnit(TrainUnit[list[Tensor]]):
    def __call__(self, batch: list[Tensor]) -> tuple[Tensor, int | None]:
        (tokens,) = batch
        return next_token_loss(self.model, tokens), tokens[:, 1:].numel()


class LlamaEvalUnit(EvalUnit[list[Tensor]]):
    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.metric_bag.register_metric("nll_loss", Mean())

    def __call__(self, batch: list[Tensor]) -> None:
        (tokens,) = batch
        num_targets = tokens[:, 1:].numel()
        loss = next_token_loss(self.model, tokens)
        self.metric_bag.nll_loss.update(loss / num_targets, weight=num_targets)


def run(gangs: Gangs, output_dir: Path, options: dict[str, Any]) -> Trainer[list[Tensor]]:
    model = build_llama(options, gangs)
    tokens = torch.randint(0, VOCAB, (16, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    dataset = TensorDataset(tokens)
    first = options["first"]
    eval_unit = LlamaEvalUnit(model)
    valid_reader = MapDataReader(dataset=dataset, batch_size=2, gang=gangs.dp, shuffle=False)
    recorder = ListRecorder()
    if first == "evaluate":
        evaluator = Evaluator(
            model=model,
            units=[eval_unit],
            data_readers=[valid_reader],
            gangs=gangs,
            recorder=recorder,
        )
        evaluator.run(0)
    trainer = Trainer(
        unit=LlamaTrainUnit(model),
        data_reader=MapDataReader(dataset=dataset, batch_size=2, gang=gangs.dp, seed=1),
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        checkpoint_manager=CheckpointManager(output_dir / "checkpoints", gangs),
        gangs=gangs,
        max_num_steps=2,
        valid_units=[eval_unit] if first == "validate" else None,
        valid_data_readers=[valid_reader] if first == "validate" else None,
        validate_at_start=first == "validate",
        validate_every_n_steps=2 if first == "validate" else None,
        checkpoint_every_n_steps=None,
        publish_metrics_every_n_steps=1,
        recorders=[recorder],
        progress=False,
    )
    trainer.run()
    if gangs.root.rank == 0:
        train = [(step, values) for run, values, step in recorder.records if run == "train"]
        result = {
            "steps": [step for step, _ in train],
            "evaluated": [[run, step] for run, _, step in recorder.records if run != "train"],
            "grad_norms": [float(values["grad_norm"]) for _, values in train],
        }
        (output_dir / "result.json").write_text(json.dumps(result))
    return trainer


def main(output_dir: Path, options: dict[str, Any]) -> None:
    runs = options.get("runs", {".": options})
    # The runs of one launch share its gangs, so the first one's dp_shard_size.
    gangs = setup_gangs(dp_shard_size=next(iter(runs.values())).get("dp_shard_size"))
    for name, run_options in runs.items():
        (output_dir / name).mkdir(exist_ok=True)
        try:
            run(gangs, output_dir / name, run_options).close()
        except BaseException as ex:
            ex.add_note(f"(in hf_validation.py's run {name})")
            raise
    leave(gangs.root)


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
