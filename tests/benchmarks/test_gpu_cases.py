"""The GPU cases (G1-paired, G2-llama, G2-checkpoint) are part of the suite, and on a machine
without CUDA each is skipped with one line saying why, its contenders recorded as skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.cases import CASE_KEYS, SuiteSettings, gpu_checkpoint, gpu_llama, gpu_overhead
from benchmarks.report import format_value
from benchmarks.workloads.llama import Llama, LlamaShape, random_tokens, summed_loss
from tests.conftest import run_python

GPU_KEYS = ("G1-paired", "G2-llama", "G2-checkpoint")
NO_CUDA = "no CUDA device here (torch.cuda.is_available() is False)"
no_cuda_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")


def test_the_gpu_cases_are_registered() -> None:
    assert set(GPU_KEYS) <= set(CASE_KEYS)
    settings = SuiteSettings(quick=True, checkpoint_params_millions=2.0)
    [paired] = gpu_overhead.comparisons(settings)
    assert paired.contenders[0].args == ("--workload", "gpu_mlp", "--hand", "plain", "--quick")
    [llama] = gpu_llama.comparisons(settings)
    assert [c.name for c in llama.contenders] == [
        "hand-written",
        "Lightning",
        "Accelerate",
        "this project",
    ]
    assert {m.key for m in llama.metrics} >= {"tokens_per_s", "mfu", "peak_memory_bytes"}
    [checkpoint] = gpu_checkpoint.comparisons(settings)
    assert {m.key for m in checkpoint.metrics} >= {"async_blocked_s", "save_gb_per_s"}


@no_cuda_only
def test_without_cuda_the_gpu_cases_are_skipped_with_one_line_each(tmp_path: Path) -> None:
    result = run_python(
        "-m",
        "benchmarks",
        "--quick",
        "--runs",
        "1",
        "--cases",
        ",".join(GPU_KEYS),
        "--output-dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    for key in GPU_KEYS:
        assert result.stdout.count(f"  {key}: skipped: {NO_CUDA}\n") == 1
    assert "FAILED" not in result.stdout
    comparisons = json.loads((tmp_path / "results.json").read_text())["comparisons"]
    assert [c["key"] for c in comparisons] == list(GPU_KEYS)
    for comparison in comparisons:
        for contender in comparison["contenders"]:
            assert contender["status"] == "skipped"
            assert contender["note"] == NO_CUDA
            assert contender["num_runs"] == 0
    assert f"this project: skipped: {NO_CUDA}" in (tmp_path / "results.md").read_text()


@no_cuda_only
def test_the_gpu_worker_says_it_needs_cuda() -> None:
    result = run_python("-m", "benchmarks.gpu_worker", "--loop", "trainer", "--quick")
    assert result.returncode == 1
    assert "gpu_worker: no CUDA device here." in result.stderr


def test_the_llama_model_has_1b_parameters_and_trains() -> None:
    with torch.device("meta"):
        full = Llama(LlamaShape())
    assert 1.0e9 < sum(p.numel() for p in full.parameters()) < 1.2e9
    shape = LlamaShape.of(quick=True)
    model = Llama(shape)
    loss, num_targets = summed_loss(model, random_tokens(shape, 2))
    assert num_targets == 2 * shape.seq_len
    # Random weights guess about uniformly over the vocabulary.
    assert loss.item() / num_targets == pytest.approx(torch.log(torch.tensor(8192.0)).item(), 0.1)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_gpu_figures_have_their_units() -> None:
    assert format_value(12.3456, "GB/s") == "12.35 GB/s"
    assert format_value(0.4213, "fraction") == "42.1%"
