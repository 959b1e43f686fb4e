"""recipes.lm with a model whose input and output embeddings are one weight (a tiny Qwen2):
it trains under FSDP2, HSDP and TP from a directory that stores the weight once, resumes and
reshards with the tie kept, and exports a directory that loads tied with ``from_pretrained``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.cli.tools import export_model
from tests.conftest import assert_ok, torchrun
from tests.recipes.test_lm import (
    TINY_TRAINING,
    last_model,
    losses,
    make_hf_model_dir,
    recipe_args,
    repeated,
    write_jsonl,
)

transformers = pytest.importorskip("transformers")
safe_open = pytest.importorskip("safetensors").safe_open

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def make_hf_tied_dir(directory: Path) -> Path:
    """A tiny Hugging Face Qwen2 with tied embeddings: its safetensors hold the weight once."""
    make_hf_model_dir(directory, architecture="Qwen2", tie_word_embeddings=True)
    with safe_open(str(directory / "model.safetensors"), framework="pt") as file:
        assert EMBED in file.keys() and HEAD not in file.keys()  # noqa: SIM118
    return directory


def tied_config(tmp_path: Path, *extra: str) -> tuple[str, ...]:
    model_dir = tmp_path / "model"
    if not model_dir.is_dir():
        make_hf_tied_dir(model_dir)
    train = tmp_path / "train.jsonl"
    if not train.is_file():
        write_jsonl(train, [{"text": s} for s in repeated(200, seed=2)])
    return (
        *TINY_TRAINING,
        f"model.hf_path={model_dir}",
        f"data.train={train}",
        "trainer.max_num_steps=6",
        "trainer.checkpoint_every_n_steps=3",
        "trainer.keep_last_n_checkpoints=null",
        *extra,
    )


def assert_tied_and_trained(out: Path, model_dir: Path) -> torch.Tensor:
    """The run's last weights hold one embedding for both names, moved from the start's."""
    state = last_model(out)
    assert torch.equal(state[EMBED], state[HEAD])
    start = transformers.AutoModelForCausalLM.from_pretrained(model_dir).get_input_embeddings()
    assert not torch.allclose(state[EMBED], start.weight)
    return state[EMBED]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        pytest.param(2, ("data_parallel=fsdp",), id="fsdp2"),
        pytest.param(
            4, ("data_parallel=hsdp", "gang.dp_shard_size=2"), id="hsdp2x2", marks=pytest.mark.slow
        ),
        pytest.param(2, ("gang.tp_size=2",), id="tp2", marks=pytest.mark.slow),
    ],
)
def test_a_tied_model_trains_and_exports_tied(
    tmp_path: Path, nproc: int, layout: tuple[str, ...]
) -> None:
    out = tmp_path / "run"
    result = torchrun(nproc, *recipe_args(out, *tied_config(tmp_path, *layout)), timeout=600)
    assert_ok(result)
    values = losses(out)
    assert len(values) == 6 and values[-1] < values[0], values
    log_text = "".join(p.read_text() for p in (out / "logs").glob("*"))
    assert f"from {tmp_path / 'model'}" in log_text  # the weight stored once set both names
    trained = assert_tied_and_trained(out, tmp_path / "model")

    destination = tmp_path / "exported"
    # In this process: the command's own test is test_lm's export test.
    export_model(out, destination, step_nr=None, best=False, lower_better=True, format="hf")
    with safe_open(str(destination / "model.safetensors"), framework="pt") as file:
        assert EMBED in file.keys() and HEAD not in file.keys()  # noqa: SIM118
    exported = transformers.AutoModelForCausalLM.from_pretrained(destination)
    embeddings = exported.get_input_embeddings().weight
    assert embeddings is exported.get_output_embeddings().weight
    assert torch.equal(embeddings.detach(), trained)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_tied_model_resumes_exactly_and_reshards_with_its_tie(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    config = tied_config(tmp_path, "data_parallel=fsdp")
    assert_ok(torchrun(2, *recipe_args(reference, *config), timeout=600))
    step_3 = str(reference / "checkpoints" / "step_3")

    resumed = tmp_path / "resumed"
    assert_ok(torchrun(2, *recipe_args(resumed, *config), "--resume-from", step_3, timeout=600))
    expected, actual = last_model(reference), last_model(resumed)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key

    # The FSDP2 checkpoint (one DTensor) in a DDP run (one plain tensor), on the same data.
    resharded = tmp_path / "resharded"
    ddp_config = tied_config(tmp_path, "data_parallel=ddp", "trainer.reshard_on_resume=true")
    assert_ok(
        torchrun(2, *recipe_args(resharded, *ddp_config), "--resume-from", step_3, timeout=600)
    )
    trained = assert_tied_and_trained(resharded, tmp_path / "model")
    torch.testing.assert_close(trained, expected[EMBED], rtol=1e-4, atol=1e-5)
