"""A step's totals over the ranks, and DDP's communication hook that carries them."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import RunTorch, assert_ok


def test_ddp_carries_exact_totals_and_the_gradients_it_would_make_without_a_hook(
    run_torchrun: RunTorch, tmp_path: Path
) -> None:
    output = tmp_path / "carrier.json"
    assert_ok(run_torchrun(2, "tests/workers/count_carrier.py", str(output)))
    results = json.loads(output.read_text())
    # Rank 0 sends (2**35 + 7, 4095, 0, 1), rank 1 (2**35 + 8, 4098, 1, 0).
    expected = [2.0**36 + 15, 8193.0, 1.0, 1.0]
    for step in range(3):
        assert results[f"received_{step}"] == expected
        assert results[f"same_grads_{step}"] is True
    # A backward with nothing sent carries nothing, and the step sums the plain way.
    assert results["received_without_send"] is None
    assert results["declines"] == {
        "a plain module": True,
        "a model with a hook": True,
        "bfloat16 gradients": True,
    }
