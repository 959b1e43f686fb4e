"""Normalizing, measuring and clipping gradients: the bits of the plain ops, and the run's flag."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gangs.torch_versions import PRIVATE_APIS_ENV_VAR
from runtime import clip_gradient_norm
from runtime.training.gradients import Gradients
from tests.conftest import assert_published_norms_are_exact, make_toy_trainer
from tests.workers.train_toy import PoisonedToyUnit, ToyModel

# The tests of Gradients run on torch's private foreach kernels and on their public fallback.
on_both_paths = pytest.mark.usefixtures("torch_private_apis")


LARGE = {"hidden_size": 131072, "max_num_steps": 2, "publish_every": 1, "reference_norms": True}
"""A toy model whose layers have 1M and 0.5M weights: a float32 norm of their gradients is some
2e-6 short, as a model's largest gradients make it."""
NORM_RUNS: dict[str, dict[str, Any]] = {
    "ddp": {"batch_size": 4, **LARGE},
    "fsdp2": {"batch_size": 4, "kind": "fsdp", **LARGE},
    "hsdp": {"batch_size": 4, "kind": "hsdp", "dp_shard_size": 1, **LARGE},
    "tp2": {"batch_size": 8, "tp_size": 2, **LARGE},
}
"""The two-rank layouts of ``norm_runs`` in tests/workers/two_rank_checks.py: DDP, FSDP2,
HSDP (2 replicas of 1 shard: the replicas count once) and TP."""


def model_with_grads(dtype: torch.dtype, *, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)
    model(torch.randn(4, 5, dtype=dtype)).sum().backward()
    return model


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@on_both_paths
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


@on_both_paths
def test_normalize_norm_and_clip_under_a_bfloat16_default_dtype() -> None:
    """The factor and the flag are float32 whatever torch's default dtype (a model built under
    ``set_default_dtype(torch.bfloat16)`` to save memory)."""
    model = model_with_grads(torch.bfloat16)
    factor = 2.0 / 37.0
    expected = [
        (g.float() * torch.tensor(factor, dtype=torch.float32)).bfloat16() for g in grads_of(model)
    ]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        gradients = Gradients(model)
        flag = gradients.normalize(factor)
        gradients.clip(1e-3, gradients.norm())
        empty_norm = Gradients(nn.Linear(2, 2)).norm()
    finally:
        torch.set_default_dtype(previous)
    assert flag is not None and flag.dtype == torch.float32 and flag.item() == 0
    assert empty_norm.dtype == torch.float32
    for actual, wanted in zip(grads_of(model), expected, strict=True):
        assert actual.abs().max() <= wanted.abs().max()


@on_both_paths
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


@on_both_paths
def test_a_changed_factor_is_applied_and_the_flag_is_one_tensor_for_the_run() -> None:
    model = model_with_grads(torch.float32)
    gradients = Gradients(model)
    before = grads_of(model)
    first = gradients.normalize(0.5)
    second = gradients.normalize(0.25)
    assert first is second
    for actual, original in zip(grads_of(model), before, strict=True):
        assert torch.equal(actual, original * 0.5 * 0.25)


@on_both_paths
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


@on_both_paths
def test_parameters_without_gradients_are_left_alone() -> None:
    model = model_with_grads(torch.float32)
    frozen = nn.Linear(2, 2)  # in the model, never used: its grad stays None
    model.append(frozen)
    flag = Gradients(model).normalize(0.5)
    assert flag is not None and flag.item() == 0
    assert all(p.grad is None for p in frozen.parameters())
    assert Gradients(nn.Linear(2, 2)).normalize(0.5) is None  # no gradients at all


@on_both_paths
def test_uncounted_parameters_are_normalized_and_clipped_but_not_measured() -> None:
    """A pipeline's last stage leaves its copy of a tied weight out of the norm (the first
    stage's copy counts it) and scales it as every other gradient."""
    model = model_with_grads(torch.float32)
    reference = model_with_grads(torch.float32)
    uncounted = model[2].weight
    counted = [p for p in reference.parameters() if p is not reference[2].weight]
    expected_norm = torch.nn.utils.clip_grad_norm_(counted, max_norm=0.1)
    coef = 0.1 / (expected_norm + 1e-6)
    expected_uncounted = reference[2].weight.grad * coef

    gradients = Gradients(model, uncounted=[uncounted])
    gradients.normalize(1.0)
    norm = gradients.norm()
    gradients.clip(0.1, norm)

    torch.testing.assert_close(norm, expected_norm, rtol=1e-6, atol=0)
    assert uncounted.grad is not None
    torch.testing.assert_close(uncounted.grad, expected_uncounted, rtol=1e-6, atol=0)
    for param, wanted in zip(model.parameters(), reference.parameters(), strict=True):
        if param is not uncounted:
            assert param.grad is not None and wanted.grad is not None
            torch.testing.assert_close(param.grad, wanted.grad, rtol=1e-6, atol=0)


@on_both_paths
def test_norm_and_clip_are_those_of_torch() -> None:
    model = model_with_grads(torch.float32)
    reference = model_with_grads(torch.float32)
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.1)

    norm = clip_gradient_norm(model, 0.1)

    assert torch.equal(norm, expected_norm)
    for actual, wanted in zip(grads_of(model), grads_of(reference), strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-6, atol=0)


def test_the_public_path_calls_no_private_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PRIVATE_APIS_ENV_VAR, "public")

    def refuse(*args: object) -> None:
        raise AssertionError("a private kernel ran on the public path")

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", refuse)
    monkeypatch.setattr(torch, "_foreach_mul_", refuse)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        model = model_with_grads(dtype)
        gradients = Gradients(model)
        flag = gradients.normalize(0.5)
        gradients.clip(0.01, gradients.norm())
        assert flag is not None and flag.item() == 0


def count_private_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the calls of the two private kernels from here on, by name, into the dict."""
    calls = {"unscale": 0, "mul": 0}
    kernels = {"unscale": "_amp_foreach_non_finite_check_and_unscale_", "mul": "_foreach_mul_"}
    for name, attribute in kernels.items():
        monkeypatch.setattr(torch, attribute, _counting(getattr(torch, attribute), name, calls))
    return calls


def _counting(kernel: Any, name: str, calls: dict[str, int]) -> Any:
    def counted(*args: Any) -> Any:
        calls[name] += 1
        return kernel(*args)

    return counted


def nan_gradients_at_step_2() -> dict[str, Any]:
    unit = PoisonedToyUnit(
        ToyModel(), poison=1.0, steps=[2], rank=0, my_rank=0, gradients_only=True
    )
    return {"unit": unit, "nan_policy": "skip"}


RUNS: dict[str, Any] = {
    "plain": dict,
    "clipping": lambda: {"max_gradient_norm": 0.05},
    "fp16": lambda: {"dtype": torch.float16, "amp": True},
    "accumulation_and_momentum": lambda: {"num_accumulate": 2, "momentum": 0.9},
    "nan_gradients_skipped": nan_gradients_at_step_2,
}


@pytest.mark.parametrize("run", RUNS)
def test_both_paths_train_the_same_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: str
) -> None:
    trained = {}
    for path in ("private", "public"):
        monkeypatch.setenv(PRIVATE_APIS_ENV_VAR, path)
        calls = count_private_kernel_calls(monkeypatch)
        torch.manual_seed(0)
        options = RUNS[run]()
        model = options["unit"].model if "unit" in options else ToyModel()
        options.setdefault("model", model)
        trainer = make_toy_trainer(tmp_path / path, max_num_steps=6, **options)
        assert trainer.run() == 0
        trained[path] = [p.detach().clone() for p in model.parameters()]
        # The private run took the fused kernel every step (and clipped with _foreach_mul_);
        # the public one took neither.
        expected_unscales = 6 if path == "private" else 0
        clipped = path == "private" and run == "clipping"
        assert calls == {"unscale": expected_unscales, "mul": 6 if clipped else 0}
    for private, public in zip(trained["private"], trained["public"], strict=True):
        assert torch.isfinite(private).all()
        assert private.dtype == public.dtype and torch.equal(private, public)


@on_both_paths
def test_the_norm_is_the_float64_norm_of_a_large_gradient() -> None:
    """A float32 norm of these 262144 equal values is 3.5e-5 short."""
    model = nn.Linear(64, 4096, bias=False)
    model.weight.grad = torch.full((4096, 64), 1e-3)
    extra = nn.Linear(3, 3, bias=False)  # a second tensor, so the per-tensor norms are combined too
    extra.weight.grad = torch.full((3, 3), 0.5)
    both = nn.ModuleList([model, extra])
    expected = torch.cat([p.grad.double().flatten() for p in both.parameters()]).norm()
    norm = Gradients(both).norm()
    assert norm.dtype == torch.float32
    assert float(norm) == pytest.approx(float(expected), rel=1e-6, abs=0)


@pytest.mark.distributed
@pytest.mark.parametrize("run", list(NORM_RUNS))
def test_every_layout_publishes_the_float64_norm_of_its_gradients(
    two_rank_checks: Path, run: str
) -> None:
    assert_published_norms_are_exact(two_rank_checks / "norm_runs" / run)
