"""The load-balancing loss of a mixture of experts split into pipeline stages: the stages pass
their routers' sums on, and the last computes ``transformers``' loss from the totals."""

from __future__ import annotations

import pytest
import torch

from models.pipeline import split_model
from tests.models.moe.test_experts import batch_of, family_model
from units.lm import IGNORE_INDEX, LMTrainUnit


@pytest.mark.parametrize(
    ("family", "split"), [("Qwen3-MoE", [1, 1]), ("OLMoE", [0, 2]), ("Qwen2-MoE", [2, 0])]
)
def test_stages_compute_the_whole_models_loss_and_router_gradients(
    family: str, split: list[int]
) -> None:
    """The two stages, run one after the other, give the logits, the load-balancing loss and
    every router's gradient of the whole model's ``output_router_logits`` forward: equal, as the
    sums are added layer by layer in ``transformers``' order. A stage without MoE layers (an
    empty split) passes the sums on unchanged."""
    model = family_model(family)
    batch = batch_of(model)
    expected = model(input_ids=batch.input_ids, output_router_logits=True)
    routers = [layer.mlp.gate.weight for layer in model.model.layers]
    expected_grads = torch.autograd.grad(expected.aux_loss, routers)

    (first,), _ = split_model(model, [0], 2, split)
    (last,), _ = split_model(model, [1], 2, split)
    hidden, sums = first(batch.input_ids)
    logits, aux_loss = last(hidden, sums)

    assert torch.equal(logits, expected.logits)
    assert torch.equal(aux_loss, expected.aux_loss)
    for grad, expected_grad in zip(
        torch.autograd.grad(aux_loss, routers), expected_grads, strict=True
    ):
        assert torch.equal(grad, expected_grad)


def test_the_unit_adds_the_last_stages_loss_weighted_by_the_microbatchs_targets() -> None:
    """``stage_loss`` of ``(logits, aux_loss)``: what ``__call__`` returns for the same
    micro-batch, the summed cross entropy plus coefficient x targets x aux loss (ignored targets
    count for nothing). The auxiliary parts are handed over once (``stage_aux_loss``) and
    recorded as ``router_aux_loss``."""
    model = family_model("Qwen3-MoE")
    batch = batch_of(model)
    unit = LMTrainUnit(model, aux_loss_coefficient=0.25)
    expected, _ = unit(batch)
    (first,), _ = split_model(model, [0], 2)
    (last,), _ = split_model(model, [1], 2)
    output = last(*first(batch.input_ids))
    aux_loss = output[1].item()

    assert unit.stage_loss(output, batch.target_ids).item() == pytest.approx(expected.item())
    targets = batch.target_ids.clone()
    targets[0, :4] = IGNORE_INDEX
    with_aux = unit.stage_loss(output, targets) - unit.stage_loss(output[0], targets)
    assert with_aux.item() == pytest.approx(0.25 * 26 * aux_loss, rel=1e-5)
    aux_part = unit.stage_aux_loss()
    assert aux_part is not None and unit.stage_aux_loss() == 0.0
    assert aux_part.item() == pytest.approx(0.25 * (30 + 26) * aux_loss, rel=1e-5)

    unit.metric_bag.router_aux_loss.reset()
    unit.record_aux_loss(batch, aux_part)
    assert unit.metric_bag.router_aux_loss.compute().item() == pytest.approx(
        (30 + 26) / 30 * aux_loss, rel=1e-5
    )
