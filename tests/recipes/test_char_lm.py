"""The char-LM recipe, run the way the README runs it, on a small slice of the stdlib."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from checkpoint import CheckpointManager
from gangs import Gangs
from recipes.char_lm import (
    ByteWindows,
    CharLMConfig,
    DataSection,
    collate_windows,
    load_corpus,
    recipe,
)
from recipes.common import warmup_cosine
from runtime.cli.config import load_config
from runtime.data.text import ByteTokenizer, prepare_dataset
from tests.conftest import RunTorch, assert_ok, read_jsonl, run_python

pytestmark = pytest.mark.distributed

# Small enough to train in seconds, large enough to learn something about Python source.
TINY = [
    "data.max_train_bytes=200000",
    "data.max_valid_bytes=20000",
    "data.seq_len=32",
    "data.batch_size=8",
    "model.dim=32",
    "model.num_heads=4",
    "model.ffn_dim=64",
    "model.num_layers=1",
    "trainer.publish_metrics_every_n_steps=5",
    "trainer.validate_every_n_steps=20",
    "trainer.checkpoint_every_n_steps=20",
    "optimizer.warmup_steps=5",
]


def test_single_process_run_learns_and_writes_every_output(
    run_torchrun: RunTorch, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    result = run_torchrun(
        1, "-m", "recipes.char_lm", str(out), "--config", *TINY, "trainer.max_num_steps=40"
    )
    assert_ok(result)

    train = read_jsonl(out / "metrics" / "train.jsonl")
    assert [r["step_nr"] for r in train] == list(range(5, 45, 5))
    # Uniform guessing over 256 bytes costs ln(256) = 5.55 nats; 40 steps learn the common bytes.
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    assert train[-1]["loss"] < 3.6

    valid = read_jsonl(out / "metrics" / "valid.jsonl")
    assert [r["step_nr"] for r in valid] == [20, 40]
    for record in valid:
        assert record["perplexity"] == pytest.approx(torch.tensor(record["nll_loss"]).exp().item())

    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["trainer"]["max_num_steps"] == 40
    assert (out / "logs" / "rank_0.log").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_20", "step_40"]
    assert list((out / "tb" / "train").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_dp_x_tp_on_four_processes_with_fsdp2(run_torchrun: RunTorch, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_torchrun(
        4,
        "-m",
        "recipes.char_lm",
        str(out),
        "--config",
        *TINY,
        "gang.tp_size=2",
        "trainer.max_num_steps=20",
        timeout=300,
    )
    assert_ok(result)
    train = read_jsonl(out / "metrics" / "train.jsonl")
    assert train[-1]["step_nr"] == 20
    assert train[-1]["loss"] < train[0]["loss"]
    # 2 DP ranks x 8 sequences x 32 targets per step.
    assert train[-1]["num_targets"] == 5 * 2 * 8 * 32
    log = (out / "logs" / "rank_0.log").read_text()
    manifest = json.loads((out / "checkpoints" / "step_20" / "manifest.json").read_text())
    assert (manifest["dp_size"], manifest["tp_size"]) == (2, 2), log[-2000:]
    assert sorted((out / "logs").iterdir()) == [out / "logs" / f"rank_{r}.log" for r in range(4)]


def test_corpus_split_is_deterministic_and_disjoint(tmp_path: Path) -> None:
    for i in range(40):
        (tmp_path / f"file_{i}.py").write_text(f"# file {i}\n" + "x = 1\n" * 50)
    section = DataSection(data_dir=tmp_path, seq_len=8, valid_every_nth_file=4)
    train, valid = load_corpus(section)
    again_train, again_valid = load_corpus(section)
    assert torch.equal(train, again_train) and torch.equal(valid, again_valid)
    assert train.numel() + valid.numel() == sum(p.stat().st_size for p in tmp_path.iterdir())
    assert 0 < valid.numel() < train.numel()


def test_too_little_text_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "tiny.txt").write_text("abc")
    with pytest.raises(ValueError, match=r"holds too little train text \(3 bytes\)"):
        load_corpus(DataSection(data_dir=tmp_path, valid_every_nth_file=1_000_000))


def test_windows_pair_each_input_with_the_next_byte() -> None:
    data = torch.arange(20, dtype=torch.uint8)
    windows = ByteWindows(data, seq_len=4)
    assert len(windows) == 3
    batch = collate_windows([windows[0], windows[1]])
    assert batch.inputs.tolist() == [[0, 1, 2, 3], [5, 6, 7, 8]]
    assert batch.targets.tolist() == [[1, 2, 3, 4], [6, 7, 8, 9]]
    assert batch.num_targets == 8


def test_schedule_warms_up_then_decays_to_a_tenth() -> None:
    factor = warmup_cosine(warmup_steps=4, total_steps=104)
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(54) == pytest.approx(0.55)
    assert factor(104) == pytest.approx(0.1)
    assert factor(500) == pytest.approx(0.1)


def test_heads_must_split_over_tp() -> None:
    config = CharLMConfig()
    config.gang.tp_size = 3
    with pytest.raises(ValueError, match=r"model\.num_heads \(4\) must be a multiple of gang"):
        config.validate()


# make test checks this error of the char-LM recipe in tests/faults/test_bad_config.py: in process
# (tp_size_not_dividing_world) and on a real terminal under torchrun; and the one line of a
# recipe's error on the terminal of one process in tests/runtime/cli/test_recipe_main.py.
@pytest.mark.slow
def test_tp_size_that_does_not_divide_the_world_exits_2_with_one_line(tmp_path: Path) -> None:
    result = run_python(
        "-m", "recipes.char_lm", str(tmp_path / "run"), "--config", "gang.tp_size=2"
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: gang.tp_size is 2, but must divide the number of processes (1). Use one of 1."
    ]


@pytest.mark.slow
def test_hsdp_with_activation_checkpointing_starts_from_another_runs_weights(
    run_torchrun: RunTorch, tmp_path: Path
) -> None:
    source = tmp_path / "source"
    steps = [
        "trainer.max_num_steps=10",
        "trainer.validate_every_n_steps=10",
        "trainer.checkpoint_every_n_steps=10",
    ]
    assert_ok(run_python("-m", "recipes.char_lm", str(source), "--config", *TINY, *steps))
    out = tmp_path / "run"
    result = run_torchrun(
        4,
        "-m",
        "recipes.char_lm",
        str(out),
        "--config",
        *TINY,
        *steps,
        "gang.dp_shard_size=2",
        "model.activation_checkpointing=true",
        f"init_from={source}",
        timeout=300,
    )
    assert_ok(result)
    log = (out / "logs" / "rank_0.log").read_text()
    assert f"Initialized 17 model tensors from {source / 'checkpoints' / 'step_10'}" in log
    # Trained on from the source's weights, not from scratch.
    assert read_jsonl(out / "metrics" / "train.jsonl")[0]["loss"] < (
        read_jsonl(source / "metrics" / "train.jsonl")[0]["loss"] - 0.3
    )
    manifest = json.loads((out / "checkpoints" / "step_10" / "manifest.json").read_text())
    assert (manifest["world_size"], manifest["dp_size"]) == (4, 4)


def test_large_model_options_are_checked() -> None:
    config = CharLMConfig()
    config.data_parallel = "hsdp"
    with pytest.raises(ValueError, match=r"gang\.dp_shard_size is not set"):
        config.validate()
    config = CharLMConfig()
    config.data_parallel = "ddp"
    config.fsdp.param_dtype = "bfloat16"
    with pytest.raises(ValueError, match="need data_parallel 'fsdp' or 'hsdp', but it is 'ddp'"):
        config.validate()


def test_a_prepared_byte_dataset_trains_and_validates_in_process(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text("".join(f"def function_{i}(x):\n    return x * {i}\n" for i in range(400)))
    prepare_dataset(tmp_path / "prepared", [text], tokenizer=ByteTokenizer(), num_workers=0)
    overrides = [
        *TINY,
        f"data.train={tmp_path / 'prepared'}",
        f"data.valid={tmp_path / 'prepared'}",
        "trainer.max_num_steps=20",
    ]
    recipe(load_config(CharLMConfig, overrides=overrides), tmp_path / "run").run()
    # BOS and EOS (256, 257) are ids of the model's vocabulary.
    manager = CheckpointManager(tmp_path / "run" / "checkpoints", Gangs.single())
    assert manager.read_model_state(20)["embed.weight"].shape == (258, 32)
    losses = [r["loss"] for r in read_jsonl(tmp_path / "run" / "metrics" / "train.jsonl")]
    assert len(losses) == 4 and losses[-1] < losses[0]
    [valid] = read_jsonl(tmp_path / "run" / "metrics" / "valid.jsonl")
    assert valid["step_nr"] == 20


_THREE_STEPS = (
    "trainer.publish_metrics_every_n_steps=1",
    "trainer.validate_every_n_steps=3",
    "trainer.checkpoint_every_n_steps=3",
    "trainer.max_num_steps=3",
)
"""The pipeline runs' length: three steps, each published, validated and checkpointed at the
last."""


@pytest.mark.slow
def test_pipeline_stages_train_as_one_process_does(run_torchrun: RunTorch, tmp_path: Path) -> None:
    """gang.pp_size=2 with interleaved 1F1B (two stages a rank, four blocks) against one process:
    train losses, gradient norms, and the valid set's loss and perplexity (which every rank
    records from the last stage's broadcast loss)."""
    config = [
        *TINY,
        "model.num_layers=4",
        *_THREE_STEPS,
    ]
    one, piped = tmp_path / "one", tmp_path / "pp2"
    assert_ok(run_torchrun(1, "-m", "recipes.char_lm", str(one), "--config", *config))
    pipeline = [
        "gang.pp_size=2",
        "pipeline.schedule=interleaved_1f1b",
        "pipeline.stages_per_rank=2",
    ]
    assert_ok(run_torchrun(2, "-m", "recipes.char_lm", str(piped), "--config", *config, *pipeline))
    _assert_trains_as(piped, one)


def _assert_trains_as(run: Path, reference: Path) -> None:
    """``run`` records the train losses, gradient norms and the valid set's loss and perplexity
    of ``reference``, within 1e-5."""
    for name, keys in (("train", ("loss", "grad_norm")), ("valid", ("nll_loss", "perplexity"))):
        records = read_jsonl(run / "metrics" / f"{name}.jsonl")
        expected = read_jsonl(reference / "metrics" / f"{name}.jsonl")
        for key in keys:
            assert [r[key] for r in records] == pytest.approx(
                [r[key] for r in expected], rel=1e-5
            ), key


@pytest.mark.slow
def test_pipeline_stages_over_hsdp_train_as_one_process_does(
    run_torchrun: RunTorch, tmp_path: Path
) -> None:
    """gang.pp_size=2 over HSDP on 8 processes (each stage's 4 DP ranks: 2 replicas of 2
    shards, 2 sequences each), 2 micro-batches a step, against one process reading 8 a
    micro-batch."""
    config = [
        *TINY,
        "model.num_layers=2",
        "data.num_accumulate=2",
        *_THREE_STEPS,
    ]
    one, piped = tmp_path / "one", tmp_path / "pp2_hsdp"
    assert_ok(run_torchrun(1, "-m", "recipes.char_lm", str(one), "--config", *config))
    layout = ["gang.pp_size=2", "gang.dp_shard_size=2", "data.batch_size=2"]
    assert_ok(
        run_torchrun(
            8, "-m", "recipes.char_lm", str(piped), "--config", *config, *layout, timeout=600
        )
    )
    _assert_trains_as(piped, one)
