"""The char-LM recipe and the README tutorial on one GPU: they learn, in float32, TF32, bf16
autocast (the default on CUDA) and FSDP2 bf16; CUDA's allocator gives the peak memory, mfu is published, a compiled run
matches eager, and the profiler records CUDA kernels."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
import torch

from runtime.metrics.device_peaks import peak_flops
from tests.conftest import assert_ok, read_jsonl, run_python
from tests.cuda.conftest import CUDA_SUITE, run_char_lm
from tests.test_readme import tutorial_code

pytestmark = CUDA_SUITE


@pytest.mark.parametrize(
    "precision",
    [
        pytest.param(("trainer.amp=false", "trainer.tf32=false"), id="float32"),
        pytest.param(("trainer.amp=false",), id="tf32"),
        pytest.param((), id="bf16-autocast-default"),
        # FSDP2 over a mesh of one GPU (a 1-rank nccl group); tests/cuda/test_two_gpus.py
        # shards over two.
        pytest.param(
            ("data_parallel=fsdp", "fsdp.param_dtype=bfloat16", "trainer.amp=false"),
            id="fsdp2-bf16",
        ),
    ],
)
def test_the_char_lm_recipe_learns_on_one_gpu(tmp_path: Path, precision: tuple[str, ...]) -> None:
    out = tmp_path / "run"
    assert_ok(run_char_lm(out, *precision, "trainer.max_num_steps=60"))
    train = read_jsonl(out / "metrics" / "train.jsonl")
    assert [r["step_nr"] for r in train] == list(range(10, 70, 10))
    # Uniform guessing over 256 bytes costs ln(256) = 5.55 nats.
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    assert train[-1]["loss"] < 3.6
    valid = read_jsonl(out / "metrics" / "valid.jsonl")
    assert [r["step_nr"] for r in valid] == [30, 60]
    assert valid[-1]["nll_loss"] < math.log(256) - 1.0
    # The log names the device it trained on.
    assert torch.cuda.get_device_name(0) in (out / "logs" / "rank_0.log").read_text()


def test_peak_memory_is_the_allocators_and_mfu_is_published(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert_ok(run_char_lm(out, "trainer.max_num_steps=20"))
    total = torch.cuda.get_device_properties(0).total_memory
    known_peak = peak_flops(torch.cuda.get_device_name(0), "bf16")
    for record in read_jsonl(out / "metrics" / "train.jsonl"):
        # The process's resident set (torch, CUDA's libraries) is over 1 GiB; the tiny model's
        # tensors on the GPU are a few MiB.
        assert 0 < record["peak_memory_bytes"] < min(total, 2**30)
        if known_peak is None:
            assert "mfu" not in record
        else:
            assert 0 < record["mfu"] < 1


def test_a_compiled_run_matches_eager(tmp_path: Path) -> None:
    losses = {}
    for compiled in (False, True):
        out = tmp_path / f"compile_{compiled}"
        assert_ok(run_char_lm(out, f"compile={str(compiled).lower()}", "trainer.max_num_steps=20"))
        losses[compiled] = [r["loss"] for r in read_jsonl(out / "metrics" / "train.jsonl")]
    # Fused kernels sum in another order: close, not equal.
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)


def test_the_profiler_records_cuda_kernels(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert_ok(
        run_char_lm(
            out,
            "trainer.profile=true",
            "trainer.profile_skip_steps=2",
            "trainer.profile_record_steps=2",
            "trainer.max_num_steps=10",
        )
    )
    (trace_file,) = (out / "profile" / "rank_0").glob("*.pt.trace.json*")
    opener = gzip.open if trace_file.suffix == ".gz" else open
    with opener(trace_file, "rt") as file:
        events = json.load(file)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert kernels, "the trace holds no CUDA kernel"
    assert any(e.get("cat") == "cuda_runtime" for e in events)


def test_the_readme_tutorial_runs_as_written_on_one_gpu(tmp_path: Path) -> None:
    script = tmp_path / "my_recipe.py"
    script.write_text(tutorial_code())
    out = tmp_path / "runs" / "mine"
    assert_ok(run_python(str(script), str(out), "--config", "max_num_steps=20", cwd=tmp_path))
    records = read_jsonl(out / "metrics" / "train.jsonl")
    assert [r["step_nr"] for r in records] == [10, 20]
    assert "mse" in records[0]
    # The Trainer ran on the GPU: CUDA's allocator, not the process's resident set, is published.
    assert records[0]["peak_memory_bytes"] < 2**30
