"""One GPU: steady steps make no host sync but the pinned ones (CUDA's own check agrees), batches
are pinned and copied one step ahead on a stream of their own without a host sync, kill -9 then resume is bit-identical, a CUDA out-of-memory is one clear error that
loses no checkpoint, the published peak memory is CUDA's allocator's, and an async checkpoint
of a GPU-resident model stages through pinned memory (its timings are reported)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from checkpoint import CheckpointManager
from gangs import Gangs
from runtime.data import DeviceDataReader, MapDataReader
from runtime.metrics.device_peaks import peak_flops
from tests.conftest import REPO_ROOT, assert_ok, child_env, read_jsonl
from tests.cuda.conftest import CUDA_RUN, CUDA_SUITE, load_params, report, run_cuda_run
from tests.faults.jobs import committed
from tests.sync_detector import (
    FEATURES,
    SYNCS_PER_STEP,
    WATCHED_STEPS,
    assert_as_pinned,
    watched_syncs,
)

pytestmark = CUDA_SUITE

# A bound so a broken run fails instead of hanging; never a measurement.
HANG_GUARD_S = 300.0


def _wait_for(path: Path, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not path.exists():
        assert process.poll() is None, f"the run ended (exit {process.returncode}) before {path}"
        assert time.monotonic() < deadline, f"{path} did not appear in {HANG_GUARD_S} s"
        time.sleep(0.02)


def test_kill_9_then_resume_is_bit_identical(tmp_path: Path) -> None:
    # Dropout draws from the CUDA generator every step: a resume that did not restore its
    # state would draw other masks and end with other weights.
    run = ("max_num_steps=30", "checkpoint_every=10", "dropout=0.2")
    reference = tmp_path / "reference"
    assert_ok(run_cuda_run(reference, *run))

    out = tmp_path / "killed"
    process = subprocess.Popen(
        [
            sys.executable,
            CUDA_RUN,
            str(out),
            "--config",
            *run,
            "mark_steps=true",
            "step_sleep=0.05",
        ],
        env=child_env(),
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    _wait_for(out / "progress" / "step_24", process)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=HANG_GUARD_S)
    assert committed(out) == [10, 20]

    assert_ok(run_cuda_run(out, *run))
    assert "from the checkpoint of step 20." in (out / "logs" / "rank_0.log").read_text()
    expected, actual = load_params(reference), load_params(out)
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name


def test_a_cuda_out_of_memory_is_one_clear_error_and_loses_no_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cuda_run(out, "max_num_steps=12", "checkpoint_every=5", "oom_at_step=7")
    assert result.returncode != 0
    output = result.stderr + (out / "logs" / "rank_0.log").read_text()
    assert "StepOutOfMemoryError: Step 7 ran out of device memory on rank 0." in output
    assert "Memory of cuda:0: " in output and " GiB allocated, " in output
    for way_out in ("activation checkpointing", "smaller micro-batch", "FSDP2"):
        assert way_out in output
    assert committed(out) == [5]
    # The run resumes from it and finishes.
    assert_ok(run_cuda_run(out, "max_num_steps=12", "checkpoint_every=5"))
    assert committed(out) == [5, 10, 12]


@pytest.mark.parametrize("amp", [False, True])
def test_the_published_peak_memory_is_cuda_allocators(tmp_path: Path, amp: bool) -> None:
    out = tmp_path / "run"
    assert_ok(run_cuda_run(out, "max_num_steps=20", "publish_every=5", f"amp={str(amp).lower()}"))
    peaks = json.loads((out / "allocator_peaks.json").read_text())
    records = read_jsonl(out / "metrics" / "train.jsonl")
    assert [r["step_nr"] for r in records] == [5, 10, 15, 20]
    known_peak = peak_flops(torch.cuda.get_device_name(0), "bf16")
    for record in records:
        # What max_memory_allocated said as the publish read and reset it (plus, at most, the
        # publish's few small tensors); each window has its own peak.
        allocator = peaks[str(record["step_nr"])]
        assert allocator <= record["peak_memory_bytes"] <= allocator + 2**20
        # mfu with no argument: 6 FLOPs per parameter and target, over the device's peak in the
        # run's precision (bf16 with amp, float32 without: TF32 is off here).
        assert (0 < record["mfu"] < 1) if known_peak else "mfu" not in record


def test_an_async_checkpoint_of_a_gpu_model_stages_through_pinned_memory(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    # 8 layers of 2048 x 2048: 134 M parameters, 1.6 GB with AdamW's two moments.
    model = nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(8))).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, 2048, device=device)).sum().backward()
    optimizer.step()
    saved = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    num_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    manager = CheckpointManager(tmp_path / "checkpoints", Gangs.single(device))

    torch.cuda.synchronize()
    start = time.perf_counter()
    manager.save_checkpoint(
        1, model=model, optimizer=optimizer, trainer_state={"step_nr": 1}, async_checkpoint=True
    )
    blocked_s = time.perf_counter() - start
    # Training goes on: the checkpoint keeps what was staged, not what the GPU holds later.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    assert manager.finish_pending_save() == 1
    save_s = time.perf_counter() - start
    staged = [
        buffer
        for writer, _ in manager._storage._staging.values()
        for buffer in (writer._buffers or {}).values()
        if isinstance(buffer, torch.Tensor)
    ]
    # Every buffer is pinned but AdamW's 0-dim `step` counts, which torch stages unpinned
    # (a few bytes each: they cost no copy time).
    unpinned = [buffer for buffer in staged if not buffer.is_pinned()]
    assert staged and all(buffer.dim() == 0 for buffer in unpinned)
    assert sum(b.numel() * b.element_size() for b in staged if b.is_pinned()) >= num_bytes

    torch.cuda.synchronize()
    start = time.perf_counter()
    manager.load_checkpoint(1, model=model, optimizer=optimizer)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - start
    for name, value in model.state_dict().items():
        assert torch.equal(value.cpu(), saved[name]), name
    manager.close()

    report(record_property, "async_checkpoint_blocked_s", blocked_s, "s")
    report(record_property, "async_checkpoint_save_gb_per_s", num_bytes / save_s / 1e9, "GB/s")
    report(record_property, "checkpoint_load_gb_per_s", num_bytes / load_s / 1e9, "GB/s")
    # Staging 1.6 GB into pinned memory runs at PCIe speed (over 10 GB/s); the write is not waited on.
    assert blocked_s < save_s


def test_batches_are_pinned_and_copied_ahead_without_a_host_sync() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    gangs = Gangs.single(device=device)
    rows = torch.arange(64.0).reshape(32, 2)
    reader = MapDataReader(
        dataset=torch.utils.data.TensorDataset(rows),
        batch_size=4,
        gang=gangs.dp,
        num_accumulate=2,
        shuffle=False,
    )
    on_device = DeviceDataReader(reader, device)
    seen = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batches in on_device:
            # A kernel on the compute stream reads each batch while the next one is copied: it
            # must see the copied values, not what the memory held before.
            seen.extend(batch[0] * 1.0 for batch in batches)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(batch.device == device for batch in seen)
    assert torch.equal(torch.cat(seen).cpu(), rows)
    # The reader itself pins for a CUDA gang, on its prefetch thread.
    reader.reset()
    assert next(reader)[0][0].is_pinned()
    on_device.close()


@pytest.mark.parametrize("feature", FEATURES)
def test_a_steady_cuda_step_host_syncs_only_where_pinned(tmp_path: Path, feature: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    window = watched_syncs(tmp_path, feature, device=device)
    assert_as_pinned(feature, window.detector.syncs)
    # CUDA's own check agrees: the pinned reads are the only syncs the device makes.
    pinned = sum(SYNCS_PER_STEP.get(feature, {}).values()) * WATCHED_STEPS
    assert len(window.cuda_syncs) == pinned, window.cuda_syncs
