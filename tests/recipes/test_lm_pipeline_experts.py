"""recipes.lm with mixtures of experts under pipeline parallelism: the load-balancing loss and
expert parallelism within each stage train as without a pipeline.

A mixture of experts' load-balancing loss is computed per forward pass (a product of means over
its tokens), so a pipeline run equals the run whose micro-batches are the pipeline's
microbatches: ``data.batch_size / pipeline.num_microbatches`` sequences, accumulated
``pipeline.num_microbatches`` times as often.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import assert_ok, read_jsonl, torchrun
from tests.recipes.families import FAMILY_BY_NAME, make_family_dir, write_train, write_valid
from tests.recipes.test_lm import TINY_TRAINING, last_model, recipe_args, run_here
from tests.recipes.test_lm_pipeline import hf_export_of

_BATCH, _ACCUMULATE, _STEPS = 4, 2, 2
"""Sequences per micro-batch and DP rank, accumulated micro-batches, and steps: the second
runs after a validation, which makes torch infer the shapes again."""

_SCHEDULES = {
    "1f1b": ("pipeline.schedule=1f1b", "pipeline.num_microbatches=2"),
    # Two stages per rank, the first and the last on rank 0, which hold no MoE layer.
    "zbv": (
        "pipeline.schedule=zbv",
        "pipeline.stages_per_rank=2",
        "pipeline.split=[0, 1, 1, 0]",
        "pipeline.num_microbatches=4",
    ),
}


def _pipelined(schedule: str) -> tuple[str, ...]:
    return (
        "gang.pp_size=2",
        *_SCHEDULES[schedule],
        f"data.batch_size={_BATCH}",
        f"data.num_accumulate={_ACCUMULATE}",
    )


def _unpipelined(schedule: str) -> tuple[str, ...]:
    """The run without a pipeline whose micro-batches are the pipeline's microbatches."""
    microbatches = int(_SCHEDULES[schedule][-1].rpartition("=")[2])
    return (
        f"data.batch_size={_BATCH // microbatches}",
        f"data.num_accumulate={_ACCUMULATE * microbatches}",
    )


def _config(tmp_path: Path, family: str) -> tuple[str, ...]:
    model_dir = make_family_dir(FAMILY_BY_NAME[family], tmp_path / "model")
    return (
        f"model.hf_path={model_dir}",
        f"data.train={write_train(tmp_path / 'train.jsonl')}",
        f"trainer.max_num_steps={_STEPS}",
        f"trainer.checkpoint_every_n_steps={_STEPS}",
        *TINY_TRAINING,
    )


def _validating(tmp_path: Path) -> tuple[str, ...]:
    """A valid set of 4 sequences, scored after every step: the steps after a forward-only run,
    which makes torch infer the shapes again."""
    valid = write_valid(tmp_path / "valid.jsonl", 4)
    return (f"data.valid={valid}", "trainer.validate_every_n_steps=1")


def _assert_trains_alike(piped: Path, reference: Path, *, aux_loss: bool) -> None:
    """The same published losses, gradient norms and expert loads at every step, and the same
    weights at the end, within float32 rounding of the microbatches' sums."""
    records = read_jsonl(piped / "metrics" / "train.jsonl")
    expected = read_jsonl(reference / "metrics" / "train.jsonl")
    assert len(records) == len(expected) == _STEPS
    keys = [k for k in expected[0] if k.startswith(("moe_", "router_aux_loss", "nll_loss"))]
    assert any(k.startswith("moe_tokens_cv_layer_") for k in keys)
    assert ("router_aux_loss" in keys) == aux_loss
    for key in ("loss", "grad_norm", "num_targets", *keys):
        assert [r[key] for r in records] == pytest.approx([r[key] for r in expected], abs=1e-5), key
    weights, expected_weights = last_model(piped), last_model(reference)
    assert weights.keys() == expected_weights.keys()
    for key, value in weights.items():
        torch.testing.assert_close(value, expected_weights[key], rtol=0, atol=1e-5, msg=key)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_qwen3_moe_under_pp2_trains_as_one_process_does(tmp_path: Path, schedule: str) -> None:
    """Qwen3-MoE (load-balancing loss 0.001), its two layers on two stages that pass the
    routers' sums on: the loss, its gradient to both stages' routers, and the expert loads of
    both stages, published by every rank. With checkpointed activations and a
    validation after every step."""
    config = _config(tmp_path, "Qwen3-MoE")
    options = (*_validating(tmp_path), "model.activation_checkpointing=true")
    reference, piped = tmp_path / "one", tmp_path / "pp2"
    assert_ok(run_here(reference, *config, *_unpipelined(schedule), *options[:2]))
    assert_ok(torchrun(2, *recipe_args(piped, *config, *_pipelined(schedule), *options)))
    _assert_trains_alike(piped, reference, aux_loss=True)
    valid = [r["nll_loss"] for r in read_jsonl(piped / "metrics" / "valid.jsonl")]
    expected = [r["nll_loss"] for r in read_jsonl(reference / "metrics" / "valid.jsonl")]
    assert len(valid) == _STEPS and valid == pytest.approx(expected, abs=1e-5)
    # The export splits the experts into the files' per-expert keys, as one process's.
    exported = hf_export_of(piped, tmp_path / "exported_pp2")
    expected_export = hf_export_of(reference, tmp_path / "exported_one")
    assert exported.keys() == expected_export.keys()
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in exported
    for key, value in exported.items():
        torch.testing.assert_close(value, expected_export[key], rtol=0, atol=1e-5, msg=key)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("family", "within_stage", "nproc"),
    [
        ("Qwen3-MoE", ("gang.ep_size=2",), 4),
        ("DeepSeek-V3", ("gang.ep_size=2",), 4),
        ("Qwen3-MoE", ("gang.tp_size=2",), 4),
        ("Qwen3-MoE", ("gang.ep_size=2", "data_parallel=fsdp"), 8),
    ],
    ids=["qwen3_moe-ep2", "deepseek_v3-ep2", "qwen3_moe-tp2", "qwen3_moe-fsdp4-ep2"],
)
def test_pp2_trains_as_its_stages_layout_does_alone(
    tmp_path: Path, family: str, within_stage: tuple[str, ...], nproc: int
) -> None:
    """Two stages, each in the layout of the run without PP on half the processes: its layers'
    experts split over two of its DP ranks (EP=2; on 8 processes each expert has a replica,
    FSDP2 shards the experts over the two), or its layers over two TP ranks, whose routers see
    the same tokens. DeepSeek-V3 (a dense first layer, shared experts, no load-balancing loss)
    moves its routers' correction biases from each stage's own loads."""
    config = _config(tmp_path, family)
    if family == "DeepSeek-V3":
        config = (*config, "model.expert_bias_update_rate=0.01")
    reference, piped = tmp_path / "alone", tmp_path / "pp2"
    reference_config = (*config, *_unpipelined("1f1b"), *within_stage)
    assert_ok(torchrun(nproc // 2, *recipe_args(reference, *reference_config), timeout=900))
    piped_config = (*config, *_pipelined("1f1b"), *within_stage)
    assert_ok(torchrun(nproc, *recipe_args(piped, *piped_config), timeout=900))
    _assert_trains_alike(piped, reference, aux_loss=family == "Qwen3-MoE")
    if family == "DeepSeek-V3":
        biases = [v for k, v in last_model(piped).items() if k.endswith("correction_bias")]
        assert len(biases) == 1 and biases[0].abs().sum() > 0, "the MoE layer's bias moved"
