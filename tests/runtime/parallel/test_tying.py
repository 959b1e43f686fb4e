"""Tied input and output embeddings stay one parameter: through materialization, FSDP2, HSDP,
tensor parallelism, a checkpoint, and initial weights that store the tied weight once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gangs import Gangs
from runtime import apply_data_parallel, load_initial_weights, materialize_model
from runtime.parallel.tying import shared_parameters
from tests.conftest import assert_ok, torchrun
from tests.workers.tied_embeddings import Block, TiedLM

WORKER = "tests/workers/tied_embeddings.py"


class UntiedLM(TiedLM):
    def __init__(self) -> None:
        super().__init__()
        self.head.weight = nn.Parameter(torch.empty_like(self.embed.weight))


def on_meta(cls: type[nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return cls()


def test_materialize_keeps_a_tie_and_initializes_it_as_its_first_holder() -> None:
    tied, untied = on_meta(TiedLM), on_meta(UntiedLM)
    materialize_model(tied, device=torch.device("cpu"), seed=3)
    materialize_model(untied, device=torch.device("cpu"), seed=3)
    assert isinstance(tied, TiedLM) and isinstance(untied, TiedLM)
    assert tied.head.weight is tied.embed.weight
    assert len(list(tied.parameters())) == len(list(untied.parameters())) - 1
    # The embedding initialized it (N(0, 1)), not the projection (uniform within 1/sqrt(dim)).
    torch.testing.assert_close(tied.embed.weight, untied.embed.weight, rtol=0, atol=0)
    torch.testing.assert_close(tied.blocks[1].up.weight, untied.blocks[1].up.weight)


def test_a_transformers_model_with_tied_embeddings_stays_tied_when_materialized() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    materialize_model(
        model, device=torch.device("cpu"), seed=1, init_fn=lambda _, m: model._init_weights(m)
    )
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert not model.get_input_embeddings().weight.is_meta


def test_fsdp_units_that_split_a_tie_are_refused_before_sharding() -> None:
    model = on_meta(TiedLM)
    with pytest.raises(ValueError, match=r"'embed.weight' and 'head.weight' are one shared") as ex:
        apply_data_parallel(model, Gangs.single(), kind="fsdp", fsdp_units=(nn.Linear,))
    assert "leave the embedding and the output projection out of fsdp_units" in str(ex.value)
    # The same modules in one unit (the root) are fine.
    apply_data_parallel(model, Gangs.single(), kind="fsdp", fsdp_units=(Block,))
    assert [t.names for t in shared_parameters(model)] == [("embed.weight", "head.weight")]


def test_initial_weights_that_store_a_tied_weight_once_set_both_names(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    model = on_meta(TiedLM)
    materialize_model(model, device=torch.device("cpu"), seed=3)
    source = on_meta(UntiedLM)
    materialize_model(source, device=torch.device("cpu"), seed=4)
    state = {k: v for k, v in source.state_dict().items() if k != "head.weight"}
    safetensors.save_file(state, str(tmp_path / "weights.safetensors"))

    loaded = load_initial_weights(model, tmp_path / "weights.safetensors", gangs=Gangs.single())
    assert isinstance(model, TiedLM) and isinstance(source, TiedLM)
    assert model.head.weight is model.embed.weight
    torch.testing.assert_close(model.embed.weight, source.embed.weight, rtol=0, atol=0)
    assert "head.weight" in loaded.loaded_keys and not loaded.skipped_keys

    # A file that lacks an untied weight is still refused.
    del state["blocks.0.up.weight"]
    safetensors.save_file(state, str(tmp_path / "partial.safetensors"))
    with pytest.raises(ValueError, match=r"1 missing key \(blocks.0.up.weight\)"):
        load_initial_weights(model, tmp_path / "partial.safetensors", gangs=Gangs.single())


# ------------------------------------------------------------------------ under torchrun


def run_worker(out: Path, nproc: int, **options: Any) -> dict[str, Any]:
    assert_ok(torchrun(nproc, WORKER, str(out), json.dumps(options), timeout=600))
    results: dict[str, Any] = torch.load(out / "results.pt", weights_only=True)
    return results


def assert_trained_tied(result: dict[str, Any]) -> None:
    assert result["tied"] == [True, True, True]
    trained: dict[str, Tensor] = result["trained"]
    assert trained.keys() == result["reference"].keys() == result["loaded"].keys()
    assert torch.equal(trained["embed.weight"], trained["head.weight"])
    for name, expected in result["reference"].items():
        torch.testing.assert_close(trained[name], expected, rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(result["loaded"][name], trained[name]), name


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("nproc", "options"),
    [
        # recipes.lm's tied Qwen2 trains under FSDP2 in make test (tests/recipes/test_lm_tied).
        pytest.param(2, {"kind": "fsdp"}, id="fsdp2", marks=pytest.mark.slow),
        pytest.param(2, {"kind": "ddp"}, id="ddp", marks=pytest.mark.slow),
        pytest.param(4, {"kind": "hsdp", "dp_shard_size": 2}, id="hsdp2x2", marks=pytest.mark.slow),
        pytest.param(4, {"kind": "fsdp", "tp_size": 2}, id="fsdp2xtp2", marks=pytest.mark.slow),
    ],
)
def test_a_tied_model_trains_as_on_one_process_and_keeps_its_tie(
    tmp_path: Path, nproc: int, options: dict[str, Any]
) -> None:
    plans = ["blocks", "vocab"] if options.get("tp_size", 1) > 1 else ["blocks"]
    results = run_worker(tmp_path, nproc, plans=plans, **options)
    for plan in plans:
        assert_trained_tied(results[plan])


@pytest.mark.distributed
@pytest.mark.slow
def test_tensor_parallelism_keeps_a_tie_or_names_the_plan_that_splits_it(tmp_path: Path) -> None:
    results = run_worker(
        tmp_path, 2, kind="fsdp", tp_size=2, plans=["blocks", "vocab", "head_only"]
    )
    assert_trained_tied(results["blocks"])
    assert_trained_tied(results["vocab"])
    message = results["head_only"]["error"]
    assert "'embed.weight' and 'head.weight' are one shared parameter" in message
    assert "the tensor-parallel plan made them a plain tensor" in message
    assert "leave both out of the plan" in message
