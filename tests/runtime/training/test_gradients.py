"""Normalizing, measuring and clipping gradients: the bits of the plain ops, and the run's flag."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from runtime import clip_gradient_norm
from runtime.training.gradients import Gradients


def model_with_grads(dtype: torch.dtype, *, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)
    model(torch.randn(4, 5, dtype=dtype)).sum().backward()
    return model


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_normalize_makes_the_bits_of_foreach_mul(dtype: torch.dtype) -> None:
    model = model_with_grads(dtype)
    expected = grads_of(model)
    factor = 2.0 / 37.0  # not a power of two: the rounding of the factor shows
    torch._foreach_mul_(expected, factor)

    flag = Gradients(model).normalize(factor)

    for actual, wanted in zip(grads_of(model), expected, strict=True):
        assert actual.dtype == dtype and torch.equal(actual, wanted)
    assert flag is not None and flag.item() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_normalize_scales_half_gradients_by_a_float32_factor(dtype: torch.dtype) -> None:
    # _foreach_mul_ with a Python float rounds the factor to the gradient's dtype first (for
    # bfloat16 an error of up to 0.4%); the normalization multiplies in float32 and rounds once.
    model = model_with_grads(dtype)
    factor = 2.0 / 37.0
    expected = [
        (g.float() * torch.tensor(factor, dtype=torch.float32)).to(dtype) for g in grads_of(model)
    ]

    Gradients(model).normalize(factor)

    for actual, wanted in zip(grads_of(model), expected, strict=True):
        assert actual.dtype == dtype and torch.equal(actual, wanted)


def test_a_changed_factor_is_applied_and_the_flag_is_one_tensor_for_the_run() -> None:
    model = model_with_grads(torch.float32)
    gradients = Gradients(model)
    before = grads_of(model)
    first = gradients.normalize(0.5)
    second = gradients.normalize(0.25)
    assert first is second
    for actual, original in zip(grads_of(model), before, strict=True):
        assert torch.equal(actual, original * 0.5 * 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_a_non_finite_gradient_raises_the_flag_and_it_stays_raised(
    dtype: torch.dtype, poison: float
) -> None:
    model = model_with_grads(dtype)
    gradients = Gradients(model)
    flag = gradients.normalize(1.0)
    assert flag is not None and flag.item() == 0

    last_bias = list(model.parameters())[-1]
    assert last_bias.grad is not None
    last_bias.grad[1] = poison
    assert gradients.normalize(0.5) is flag and flag.item() != 0

    model.zero_grad(set_to_none=True)
    model(torch.randn(4, 5, dtype=dtype)).sum().backward()
    gradients.normalize(0.5)
    assert flag.item() != 0  # a later finite step does not clear it


def test_parameters_without_gradients_are_left_alone() -> None:
    model = model_with_grads(torch.float32)
    frozen = nn.Linear(2, 2)  # in the model, never used: its grad stays None
    model.append(frozen)
    flag = Gradients(model).normalize(0.5)
    assert flag is not None and flag.item() == 0
    assert all(p.grad is None for p in frozen.parameters())
    assert Gradients(nn.Linear(2, 2)).normalize(0.5) is None  # no gradients at all


def test_norm_and_clip_are_those_of_torch() -> None:
    model = model_with_grads(torch.float32)
    reference = model_with_grads(torch.float32)
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.1)

    norm = clip_gradient_norm(model, 0.1)

    assert torch.equal(norm, expected_norm)
    for actual, wanted in zip(grads_of(model), grads_of(reference), strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-6, atol=0)
