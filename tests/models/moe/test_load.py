"""Per-layer expert load and the aux-loss-free bias update of ``models.moe.load``."""

from __future__ import annotations

import pytest
import torch

from gangs import Gangs
from models.moe import ExpertBiasUpdate, ExpertTokens, MoeLMTrainUnit, correction_biases
from recipes.lm import LMConfig, bias_update
from runtime.cli.config import load_config
from tests.models.moe.test_experts import batch_of, family_model

transformers = pytest.importorskip("transformers")


def test_the_expert_load_is_counted_once_per_token_with_activation_checkpointing() -> None:
    """Each layer's tokens per expert over the micro-batches of a publish window, each routed
    token-expert pair once though the backward recomputes the layers."""
    from torch.utils.checkpoint import checkpoint

    model = family_model("Mixtral")
    layers = model.model.layers
    for layer in layers:
        forward = layer.forward
        layer.forward = lambda *a, _f=forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)
    unit = MoeLMTrainUnit(model)
    assert unit.expert_load is not None
    routed: list[torch.Tensor] = []
    layers[1].mlp.experts.register_forward_pre_hook(lambda _, args: routed.append(args[1]))
    batch = batch_of(model, rows=2, length=6)
    for _ in range(2):
        loss, _ = unit(batch)
        loss.backward()
    assert len(routed) == 4  # two forwards and two recomputations
    counts = torch.bincount(torch.cat([routed[0], routed[2]]).flatten(), minlength=4).double()
    values = unit.metric_bag.sync_and_compute(Gangs.single().dp)
    assert values["moe_tokens_min_layer_1"] == counts.min().item()
    assert values["moe_tokens_max_layer_1"] == counts.max().item()
    assert values["moe_idle_experts_layer_1"] == int((counts == 0).sum())
    cv = (counts.std(correction=0) / counts.mean()).item()
    assert values["moe_tokens_cv_layer_1"] == pytest.approx(cv)
    assert counts.sum() == 2 * 2 * 2 * 6  # forwards x top-2 x rows x length
    assert {f"moe_tokens_max_layer_{n}" for n in (0, 1)} <= values.keys()


def test_the_expert_load_of_one_expert_taking_everything() -> None:
    counts = torch.tensor([0.0, 12.0, 0.0, 0.0])
    assert ExpertTokens(4, "cv").update(counts).compute().item() == pytest.approx(3**0.5)
    assert ExpertTokens(4, "idle").update(counts).compute().item() == 3
    with pytest.raises(ValueError, match="stat must be one of"):
        ExpertTokens(4, "mean")


def test_the_bias_moves_towards_the_experts_that_received_fewer_tokens() -> None:
    """DeepSeek-V3's correction bias: after a step, up for the experts under the step's mean
    load, down for those over it, centred; a model buffer, so in the checkpointed state."""
    model = family_model("DeepSeek-V3")
    unit = MoeLMTrainUnit(model)
    assert unit.expert_load is not None
    biases = correction_biases(model)
    assert list(biases) == [1]  # the first layer is dense
    update = ExpertBiasUpdate(unit.expert_load, biases, Gangs.single().dp, rate=0.01)
    routed: list[torch.Tensor] = []
    model.model.layers[1].mlp.experts.register_forward_pre_hook(
        lambda _, args: routed.append(args[1])
    )
    batch = batch_of(model)
    update.on_step_begin(step_nr=1, batches=[batch])
    unit(batch)
    update.on_before_optimizer_step(step_nr=1, model=model)

    counts = torch.bincount(routed[0].flatten(), minlength=4).float()
    expected = 0.01 * torch.sign(counts.mean() - counts)
    expected -= expected.mean()
    assert expected.abs().sum() > 0
    torch.testing.assert_close(biases[1], expected)
    assert torch.equal(
        model.state_dict()["model.layers.1.mlp.gate.e_score_correction_bias"], expected
    )


def test_a_bias_update_for_routers_without_a_bias_is_refused() -> None:
    unit = MoeLMTrainUnit(family_model("Qwen3-MoE"))
    with pytest.raises(ValueError, match=r"expert_bias_update_rate \(0.001\).*Leave it unset"):
        bias_update(0.001, unit, Gangs.single())
    config = load_config(
        LMConfig,
        overrides=["model.name=llama_debug", "data.train=x", "model.expert_bias_update_rate=0.001"],
    )
    assert config.model.expert_bias_update_rate == 0.001
