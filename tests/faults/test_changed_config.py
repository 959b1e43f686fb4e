"""An output directory holding a run with another config: resume what can, refuse what cannot."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from checkpoint import CheckpointManager
from gangs import Gangs
from tests.conftest import assert_ok
from tests.faults.conftest import Tally
from tests.faults.jobs import committed, run_single

pytestmark = pytest.mark.faults


def test_resumable_changes_go_through_and_shape_changes_are_refused(
    tmp_path: Path, tally: Tally
) -> None:
    out = tmp_path / "run"
    assert_ok(run_single(out, "max_num_steps=4"))

    # More steps and other cadences: the run goes on from step 4 and says what changed.
    extended = run_single(out, "max_num_steps=6", "publish_every=3", "checkpoint_every=3")
    changes = "checkpoint_every: 2 -> 3; max_num_steps: 4 -> 6; publish_every: 2 -> 3"
    ok = (
        extended.returncode == 0
        and changes in extended.stderr
        and "Resumed from the checkpoint of step 4." in extended.stderr
        and committed(out) == [2, 4, 6]
    )
    tally.add(survived=ok, detail=extended.stderr[-3000:])
    config_after_extension = (out / "config.yaml").read_text()

    # Another model shape cannot load the checkpoints: refused, everything kept as it was.
    reshaped = run_single(
        out, "max_num_steps=6", "publish_every=3", "checkpoint_every=3", "hidden_size=32"
    )
    errors = [line for line in reshaped.stderr.splitlines() if line.startswith("error: ")]
    ok = (
        reshaped.returncode == 2
        and len(errors) == 1
        and "hidden_size: 16 -> 32" in errors[0]
        and "To start fresh, pass another OUTPUT_DIR" in errors[0]
        and "to resume, run with the old values again" in errors[0]
        and (out / "config.yaml").read_text() == config_after_extension
        and yaml.safe_load(config_after_extension)["hidden_size"] == 16
        and committed(out) == [2, 4, 6]
        and not CheckpointManager(out / "checkpoints", Gangs.single()).damaged_dirs()
    )
    tally.add(survived=ok, detail=reshaped.stderr[-3000:])
    tally.check()
