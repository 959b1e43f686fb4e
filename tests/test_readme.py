"""The docs' recipes are the code that runs: the README's tutorial runs as written, on one process
and under torchrun, and docs/extending.md shows docs/examples/dpo_recipe.py (which
tests/test_wheel.py runs) as the file holds it."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, RunTorch, assert_ok, run_python


def first_python_block(page: Path, heading: str) -> str:
    """The first fenced python block of ``page`` after the line ``heading``."""
    parts = page.read_text().split(f"\n{heading}\n", 1)
    assert len(parts) == 2, f"{page.name} has no heading {heading!r}"
    match = re.search(r"```python\n(.*?)```", parts[1], re.DOTALL)
    assert match is not None, f"{page.name} has no python block after {heading!r}"
    return match.group(1)


def tutorial_code() -> str:
    return first_python_block(REPO_ROOT / "README.md", "## Tutorial")


def test_extending_md_shows_the_dpo_recipe_example_as_its_file_holds_it() -> None:
    shown = first_python_block(
        REPO_ROOT / "docs" / "extending.md", "## Your own recipe from the installed parts"
    )
    example = (REPO_ROOT / "docs" / "examples" / "dpo_recipe.py").read_text()
    assert shown == example, "copy docs/examples/dpo_recipe.py into docs/extending.md's block"


@pytest.mark.distributed
def test_tutorial_recipe_trains_resumes_and_takes_overrides(
    tmp_path: Path, run_torchrun: RunTorch
) -> None:
    script = tmp_path / "my_recipe.py"
    script.write_text(tutorial_code())

    # The two-process run is independent of the one-process runs: it goes on beside them, on the
    # core a single process leaves idle.
    dp_out = tmp_path / "runs" / "dp"
    with ThreadPoolExecutor(max_workers=1) as pool:
        two_processes = pool.submit(
            run_torchrun, 2, str(script), str(dp_out), "--config", "max_num_steps=20", cwd=REPO_ROOT
        )

        out = tmp_path / "runs" / "mine"
        single = run_python(str(script), str(out), "--config", "max_num_steps=20", cwd=tmp_path)
        assert_ok(single)
        records = [json.loads(line) for line in (out / "metrics" / "train.jsonl").open()]
        assert [r["step_nr"] for r in records] == [10, 20]
        assert "mse" in records[0]

        # The same command again finds the finished run and does not train further.
        again = run_python(str(script), str(out), "--config", "max_num_steps=20", cwd=tmp_path)
        assert_ok(again)
        assert len((out / "metrics" / "train.jsonl").read_text().splitlines()) == 2

        result = two_processes.result()
    assert_ok(result)
    assert (dp_out / "checkpoints" / "step_20" / "manifest.json").is_file()
    assert sorted(p.name for p in (dp_out / "logs").iterdir()) == ["rank_0.log", "rank_1.log"]
