"""recipes.lm under pipeline parallelism: gang.pp_size=2 on two processes trains as one process
does, and what cannot run is refused in one line with exit 2."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.conftest import (
    assert_ok,
    kill_9_after_first_checkpoint,
    make_tokenizer_dir,
    needs_cpp_compiler,
    read_jsonl,
    sft_records,
    torchrun,
    torchrun_command,
)
from tests.recipes.families import FAMILIES, FAMILY_BY_NAME, Family, make_family_dir
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
    # Tied embeddings with the first stage on rank 0 and the last on rank 1: a copy on each.
    "qwen2_tied_1f1b": ("pipeline.schedule=1f1b",),
    "qwen2_tied_interleaved_1f1b": (
        "pipeline.schedule=interleaved_1f1b",
        "pipeline.stages_per_rank=2",
        "pipeline.num_microbatches=2",
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
        pytest.param("qwen2_tied_1f1b", marks=pytest.mark.slow),
        pytest.param("qwen2_tied_interleaved_1f1b", marks=pytest.mark.slow),
    ],
)
def test_pp2_trains_as_one_process_does(tmp_path: Path, model: str) -> None:
    """The project's Llama from scratch, or a Hugging Face Qwen2 fine-tuned from its directory
    (each stage loads its own weights), with tied embeddings too (on one rank under ZBV, a copy
    on each of two ranks under 1F1B and interleaved 1F1B, set from the directory's one tensor);
    the pipeline run checkpoints its activations."""
    config = _config(tmp_path)
    if model != "llama_debug":
        tied = model.startswith("qwen2_tied")
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
    # The checkpoint holds the whole model's names: it reads as one process's does. Microbatches
    # sum in another order than one batch, and AdamW divides each gradient by its own size, so
    # a gradient near zero shows float32 rounding in its update: 5e-5 over 3 steps of lr 1e-2
    # (tests/runtime/parallel/test_pipeline.py holds a smaller model to 1e-5).
    assert_same_run(piped, reference, weights_tolerance=5e-5)


def assert_same_run(piped: Path, reference: Path, *, weights_tolerance: float = 1e-5) -> None:
    """Losses, gradient norms and target counts within 1e-5 of the one-process run's, and the
    final weights within ``weights_tolerance``."""
    records = read_jsonl(piped / "metrics" / "train.jsonl")
    expected = read_jsonl(reference / "metrics" / "train.jsonl")
    assert len(records) == len(expected)
    for key in ("loss", "grad_norm", "num_targets"):
        assert [r[key] for r in records] == pytest.approx([r[key] for r in expected], abs=1e-5)
    weights, expected_weights = last_model(piped), last_model(reference)
    assert weights.keys() == expected_weights.keys()
    for key, value in weights.items():
        torch.testing.assert_close(
            value, expected_weights[key], rtol=0, atol=weights_tolerance, msg=key
        )


def family_pipeline(family: Family) -> tuple[str, ...]:
    """1F1B, or ZBV for a family with tied embeddings (first and last stage on rank 0)."""
    tied = family.config(19).tie_word_embeddings
    return PIPELINES["qwen2_tied" if tied else "qwen2"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("family", [pytest.param(f, id=f.slug) for f in FAMILIES if not f.experts])
def test_every_dense_family_trains_at_pp2_as_one_process_does(
    tmp_path: Path, family: Family
) -> None:
    """Each dense family of the matrix fine-tuned from its directory, on sequences longer than
    Mistral's and Gemma 2's sliding windows, with its activations checkpointed per stage: PP=2
    follows the one-process run. Without dropout (GPT-2's): the stages draw other masks."""
    model_dir = make_family_dir(family, tmp_path / "model", dropout=False)
    config = (f"model.hf_path={model_dir}", *_config(tmp_path)[2:])
    reference, piped = tmp_path / "one", tmp_path / "pp2"
    assert_ok(run_here(reference, *config))
    options = ("gang.pp_size=2", *family_pipeline(family), "model.activation_checkpointing=true")
    assert_ok(torchrun(2, *recipe_args(piped, *config, *options), timeout=600))
    assert_same_run(piped, reference)


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
            (
                "gang.pp_size=2",
                "pipeline.schedule=dualpipev",
                "pipeline.stages_per_rank=2",
                "compile=true",
            ),
            "pipeline.schedule=dualpipev splits each backward into an input and a weight pass",
        ),
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


def test_a_family_the_stages_do_not_reproduce_is_refused_before_the_launch(
    tmp_path: Path,
) -> None:
    """Granite scales its embeddings, residuals and logits by config factors that no stage
    applies: refused at the config, in one line, with exit 2."""
    model_dir = make_hf_model_dir(tmp_path / "granite", architecture="Granite")
    config = (f"model.hf_path={model_dir}", *_config(tmp_path)[2:], "gang.pp_size=2")
    result = run_here(tmp_path / "run", *config)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert "model.hf_path (model_type 'granite') does not split" in lines[0]
    assert "Use gang.pp_size=1." in lines[0]


def test_more_stages_than_gpt2_layers_are_refused_before_the_launch(tmp_path: Path) -> None:
    """GPT-2's config.json counts its layers as n_layer: the recipe reads it too."""
    model_dir = make_family_dir(FAMILY_BY_NAME["GPT-2"], tmp_path / "gpt2")
    config = (
        f"model.hf_path={model_dir}",
        *_config(tmp_path)[2:],
        "gang.pp_size=2",
        "pipeline.schedule=interleaved_1f1b",
        "pipeline.stages_per_rank=2",
        "pipeline.split=[1, 1, 1, 0]",
    )
    result = run_here(tmp_path / "run", *config)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert "summing to the model's 2 layers, but is [1, 1, 1, 0]" in lines[0]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        # data_parallel=auto: FSDP2 over the two DP ranks of each stage, 4 examples each.
        (4, ("gang.pp_size=2", "data.batch_size=4")),
        # DDP around each stage, on request.
        (4, ("gang.pp_size=2", "data_parallel=ddp", "data.batch_size=4")),
        (4, ("gang.pp_size=2", "gang.tp_size=2", "data.batch_size=8")),
        # Each stage's 4 DP ranks: 2 replicas of 2 shards, 2 examples each.
        (8, ("gang.pp_size=2", "gang.dp_shard_size=2", "data.batch_size=2")),
        # FSDP2 under a split backward: the 4 microbatches zbv needs, one example each.
        (4, ("gang.pp_size=2", "data.batch_size=4", *PIPELINES["qwen2_tied"])),
    ],
    ids=["pp2_fsdp2", "pp2_ddp", "pp2_tp2", "pp2_hsdp", "pp2_fsdp2_zbv"],
)
def test_pp2_composes_with_data_and_tensor_parallelism(
    tmp_path: Path, nproc: int, layout: tuple[str, ...]
) -> None:
    config = _config(tmp_path)
    reference, piped = tmp_path / "one", tmp_path / "pp2"
    assert_ok(run_here(reference, *config, "data.batch_size=8"))
    assert_ok(torchrun(nproc, *recipe_args(piped, *config, *layout), timeout=600))
    # The tolerance of test_pp2_trains_as_one_process_does (AdamW's updates of near-zero
    # gradients).
    assert_same_run(piped, reference, weights_tolerance=5e-5)


def hf_export_of(out: Path, destination: Path) -> dict[str, torch.Tensor]:
    """``python -m runtime export OUT DESTINATION --format hf`` (its main, in this process):
    the tensors of the file it writes, as stored."""
    from runtime.cli.tools import main as runtime_main

    assert runtime_main(["export", str(out), str(destination), "--format", "hf"]) == 0
    with safe_open(str(destination / "model.safetensors"), framework="pt") as file:
        return {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("model", ["qwen2", "qwen2_tied", "qwen2_tied_1f1b"])
def test_pp2_resumes_bitwise_after_kill_9_and_exports_what_one_process_exports(
    tmp_path: Path, model: str
) -> None:
    """A Hugging Face Qwen2 under PP=2 (1F1B; tied embeddings under ZBV, and under 1F1B with a
    copy on each rank), checkpointed every 2 of 6 steps: kill -9 of every process after the
    first checkpoint, and the rerun ends with exactly the weights of the uninterrupted PP=2 run.
    Its export holds the keys of the export of the same run in one process, one tensor for the
    tied embedding, the same weights within the float32 rounding of the microbatches' sums."""
    tied = model.startswith("qwen2_tied")
    model_dir = make_hf_model_dir(
        tmp_path / "model", architecture="Qwen2", tie_word_embeddings=tied
    )
    config = (
        f"model.hf_path={model_dir}",
        *_config(tmp_path)[2:],
        "trainer.max_num_steps=6",
        "trainer.checkpoint_every_n_steps=2",
        "trainer.keep_last_n_checkpoints=null",
    )
    piped = (*config, "gang.pp_size=2", *PIPELINES[model])
    one, reference, out = tmp_path / "one", tmp_path / "pp2", tmp_path / "killed"
    assert_ok(run_here(one, *config))
    assert_ok(torchrun(2, *recipe_args(reference, *piped), timeout=600))

    killed_at = kill_9_after_first_checkpoint(torchrun_command(2, recipe_args(out, *piped)), out)
    assert max(killed_at) < 6, "killed after the run's end: nothing was resumed"
    assert_ok(torchrun(2, *recipe_args(out, *piped), timeout=600))
    assert (
        f"Resumed from the checkpoint of step {max(killed_at)}."
        in (out / "logs" / "rank_0.log").read_text()
    )
    names = ("step_nr", "loss", "grad_norm", "num_targets")
    expected_records = {r["step_nr"]: r for r in read_jsonl(reference / "metrics" / "train.jsonl")}
    for record in read_jsonl(out / "metrics" / "train.jsonl")[-2:]:
        assert {n: record[n] for n in names} == {
            n: expected_records[record["step_nr"]][n] for n in names
        }
    expected, resumed = last_model(reference), last_model(out)
    assert resumed.keys() == expected.keys()
    for key in expected:
        assert torch.equal(resumed[key], expected[key]), key

    exported = hf_export_of(out, tmp_path / "exported_pp2")
    expected_export = hf_export_of(one, tmp_path / "exported_one")
    assert exported.keys() == expected_export.keys()
    if tied:
        assert "lm_head.weight" not in exported and "model.embed_tokens.weight" in exported
    # The tolerance of test_pp2_trains_as_one_process_does, over twice the steps.
    for key, value in exported.items():
        torch.testing.assert_close(value, expected_export[key], rtol=0, atol=1e-4, msg=key)


COMPILED_PIPELINES = {
    "Mistral": ("pipeline.schedule=1f1b",),
    # Two stages a rank, looped: rank 0 holds the embedding and layer 1, rank 1 layer 0 and the
    # head.
    "Qwen3": (
        "pipeline.schedule=interleaved_1f1b",
        "pipeline.stages_per_rank=2",
        "pipeline.split=[0, 1, 1, 0]",
    ),
}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("family", sorted(COMPILED_PIPELINES))
def test_pp2_compiles_and_checkpoints_each_stage_as_one_process_trains(
    tmp_path: Path, family: str
) -> None:
    """compile=true and activation checkpointing under PP=2 (1F1B, and interleaved 1F1B with two
    stages a rank) against the one-process eager run. (The V-shaped schedules refuse
    compile=true: test_refusals_exit_2_in_one_line.)"""
    needs_cpp_compiler()
    model_dir = make_family_dir(FAMILY_BY_NAME[family], tmp_path / "model", dropout=False)
    config = (f"model.hf_path={model_dir}", *_config(tmp_path)[2:])
    reference, piped = tmp_path / "one", tmp_path / "pp2"
    assert_ok(run_here(reference, *config))
    options = (
        "gang.pp_size=2",
        *COMPILED_PIPELINES[family],
        "compile=true",
        "model.activation_checkpointing=true",
    )
    # A cache of its own: inductor compiles here, and nothing compiled elsewhere is reused.
    cache = tmp_path / "inductor"
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
    assert_ok(torchrun(2, *recipe_args(piped, *config, *options), env=env, timeout=600))
    assert any(cache.rglob("*.py")), "nothing was compiled"
    assert_same_run(piped, reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_pp2_sft_of_a_hugging_face_model_equals_one_process(tmp_path: Path) -> None:
    """task=sft of a Mistral (sliding window 16) at PP=2 under 1F1B: examples of up to 30 tokens
    right-padded to the longest of each batch, prompts and padding ignored as targets, a valid
    set whose last batch of one is padded up to the microbatches."""
    model_dir = make_family_dir(FAMILY_BY_NAME["Mistral"], tmp_path / "model", dropout=False)
    rng = random.Random(5)

    def records(count: int) -> list[dict[str, object]]:
        return sft_records(rng, count, max_prompt_words=24)

    config = (
        "task=sft",
        f"model.hf_path={model_dir}",
        f"data.train={write_jsonl(tmp_path / 'train.jsonl', records(40))}",
        f"data.valid={write_jsonl(tmp_path / 'valid.jsonl', records(9))}",
        "trainer.max_num_steps=4",
        "trainer.checkpoint_every_n_steps=4",
        *TINY_TRAINING,
        "trainer.validate_every_n_steps=2",
    )
    reference, piped = tmp_path / "one", tmp_path / "pp2"
    assert_ok(run_here(reference, *config))
    assert_ok(torchrun(2, *recipe_args(piped, *config, "gang.pp_size=2"), timeout=600))
    assert_same_run(piped, reference)
    valid = read_jsonl(piped / "metrics" / "valid.jsonl")
    expected = read_jsonl(reference / "metrics" / "valid.jsonl")
    assert [r["step_nr"] for r in valid] == [r["step_nr"] for r in expected] == [2, 4]
    scores = [r["nll_loss"] for r in valid]
    assert scores == pytest.approx([r["nll_loss"] for r in expected], abs=1e-5)
