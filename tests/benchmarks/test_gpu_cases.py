"""The GPU cases (G1-paired, G2-llama, G2-checkpoint) are part of the suite, and on a machine
without CUDA each is skipped with one line saying why, its contenders recorded as skipped."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks import gpu_worker
from benchmarks.cases import CASE_KEYS, SuiteSettings, gpu_checkpoint, gpu_llama, gpu_overhead
from benchmarks.report import format_value
from benchmarks.workloads.llama import Llama, LlamaShape, random_tokens, summed_loss
from tests.benchmarks.conftest import GPU_KEYS, QuickRun

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
def test_without_cuda_the_gpu_cases_are_skipped_with_one_line_each(quick_run: QuickRun) -> None:
    result = quick_run.result
    assert result.returncode == 0, result.stderr
    for key in GPU_KEYS:
        assert result.stdout.count(f"  {key}: skipped: {NO_CUDA}\n") == 1
    assert "FAILED" not in result.stdout
    assert [key for key in quick_run.cases if key in GPU_KEYS] == list(GPU_KEYS)
    for key in GPU_KEYS:
        for contender in quick_run.comparison(key)["contenders"]:
            assert contender["status"] == "skipped"
            assert contender["note"] == NO_CUDA
            assert contender["num_runs"] == 0
    table = (quick_run.output_dir / "results.md").read_text()
    assert f"this project: skipped: {NO_CUDA}" in table


@no_cuda_only
def test_the_gpu_worker_says_it_needs_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its main in this process: the refusal comes before the worker builds anything.
    monkeypatch.setattr(sys, "argv", ["gpu_worker", "--loop", "trainer", "--quick"])
    with pytest.raises(SystemExit) as exit_info:
        gpu_worker.main()
    # Exit status 1, the message on stderr.
    assert exit_info.value.code == "gpu_worker: no CUDA device here."


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
