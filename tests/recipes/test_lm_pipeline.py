"""recipes.lm under pipeline parallelism: gang.pp_size=2 on two processes trains as one process
does, and what cannot run is refused in one line with exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import assert_ok, make_tokenizer_dir, read_jsonl, torchrun
from tests.recipes.test_lm import (
    TINY_TRAINING,
    last_model,
    make_hf_model_dir,
    recipe_args,
    run_here,
    sentences,
    write_jsonl,
)


def _config(tmp_path: Path) -> tuple[str, ...]:
    tokenizer_dir = make_tokenizer_dir(tmp_path / "tok", sentences(200, seed=0))
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": s} for s in sentences(120, seed=2)])
    return (
        "model.name=llama_debug",
        f"tokenizer.path={tokenizer_dir}",
        f"data.train={train}",
        "trainer.max_num_steps=3",
        "trainer.checkpoint_every_n_steps=3",
        *TINY_TRAINING,
    )


PIPELINES = {
    "llama_debug": ("pipeline.schedule=1f1b",),
    "qwen2": ("pipeline.schedule=1f1b",),
    # Tied embeddings: a V-shaped schedule puts the first and last stages on rank 0.
    "qwen2_tied": (
        "pipeline.schedule=zbv",
        "pipeline.stages_per_rank=2",
        "pipeline.split=[0, 1, 1, 0]",
    ),
}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "model",
    [
        "llama_debug",
        pytest.param("qwen2", marks=pytest.mark.slow),
        pytest.param("qwen2_tied", marks=pytest.mark.slow),
    ],
)
def test_pp2_trains_as_one_process_does(tmp_path: Path, model: str) -> None:
    """The project's Llama from scratch, or a Hugging Face Qwen2 fine-tuned from its directory
    (each stage loads its own weights), with tied embeddings too; the pipeline run checkpoints
    its activations."""
    config = _config(tmp_path)
    if model != "llama_debug":
        tied = model == "qwen2_tied"
        model_dir = make_hf_model_dir(
            tmp_path / model, architecture="Qwen2", tie_word_embeddings=tied
        )
        config = (f"model.hf_path={model_dir}", *config[2:])
    reference, piped = tmp_path / "one", tmp_path / "pp2"
    assert_ok(run_here(reference, *config))
    assert_ok(
        torchrun(
            2,
            *recipe_args(
                piped,
                *config,
                "gang.pp_size=2",
                *PIPELINES[model],
                # Per stage, in place: the same numbers.
                "model.activation_checkpointing=true",
            ),
        )
    )
    records = read_jsonl(piped / "metrics" / "train.jsonl")
    expected = read_jsonl(reference / "metrics" / "train.jsonl")
    for key in ("loss", "grad_norm", "num_targets"):
        assert [r[key] for r in records] == pytest.approx([r[key] for r in expected], abs=1e-5)
    # The checkpoint holds the whole model's names: it reads as one process's does. Microbatches
    # sum in another order than one batch, and AdamW divides each gradient by its own size, so
    # a gradient near zero shows float32 rounding in its update: 5e-5 over 3 steps of lr 1e-2
    # (tests/runtime/parallel/test_pipeline.py holds a smaller model to 1e-5).
    weights, expected_weights = last_model(piped), last_model(reference)
    assert weights.keys() == expected_weights.keys()
    for key, value in weights.items():
        torch.testing.assert_close(value, expected_weights[key], rtol=0, atol=5e-5, msg=key)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("gang.pp_size=2",), "gang.pp_size is 2, but must divide the number of processes (1)"),
        (
            ("gang.pp_size=2", "pipeline.num_microbatches=3"),
            "pipeline.num_microbatches (3) must divide the batch size (4)",
        ),
        (
            ("gang.pp_size=2", "pipeline.schedule=zbv", "pipeline.num_microbatches=2"),
            "pipeline.schedule=zbv runs exactly two stages per rank",
        ),
        (("gang.pp_size=2", "task=dpo"), "gang.pp_size (2) trains task=pretrain"),
        (
            ("gang.pp_size=2", "pipeline.schedule=interleaved_1f1b", "pipeline.stages_per_rank=2"),
            "The pipeline has 4 stages, but the model has only 2 layers",
        ),
        (
            ("gang.pp_size=2", "pipeline.split=[2, 1]"),
            "pipeline.split must give the layers of each of the 2 stages, summing to the model's",
        ),
    ],
)
def test_refusals_exit_2_in_one_line(
    tmp_path: Path, options: tuple[str, ...], message: str
) -> None:
    result = run_here(tmp_path / "run", *_config(tmp_path), *options)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], result.stderr


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout",
    [
        # data_parallel=auto: FSDP2 over the two DP ranks of each stage, 4 examples each.
        ("gang.pp_size=2", "data.batch_size=4"),
        ("gang.pp_size=2", "gang.tp_size=2", "data.batch_size=8"),
    ],
    ids=["pp2_fsdp2", "pp2_tp2"],
)
def test_pp2_composes_with_fsdp2_and_tp2_on_four_processes(
    tmp_path: Path, layout: tuple[str, ...]
) -> None:
    config = _config(tmp_path)
    reference, piped = tmp_path / "one", tmp_path / "pp2"
    assert_ok(run_here(reference, *config, "data.batch_size=8"))
    assert_ok(torchrun(4, *recipe_args(piped, *config, *layout)))
    records = read_jsonl(piped / "metrics" / "train.jsonl")
    expected = read_jsonl(reference / "metrics" / "train.jsonl")
    for key in ("loss", "grad_norm", "num_targets"):
        assert [r[key] for r in records] == pytest.approx([r[key] for r in expected], abs=1e-5)
