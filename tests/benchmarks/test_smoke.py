"""The benchmark suite runs end to end and writes its JSON and Markdown (no figure is checked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.__main__ import main
from benchmarks.cases.base import PAIRED, PAIRED_COUNTED
from tests.benchmarks.conftest import QuickRun
from tests.conftest import assert_ok, run_quick_benchmark


def test_quick_suite_writes_json_and_markdown(quick_run: QuickRun) -> None:
    assert_ok(quick_run.result)

    results = json.loads((quick_run.output_dir / "results.json").read_text())
    assert results["suite"]["runs"] == 1
    assert results["suite"]["quick"] is True
    assert {"platform", "cpu_count", "python", "torch", "frameworks"} <= set(results["machine"])
    # Every case asked for, in the order asked.
    assert [c["key"] for c in results["comparisons"]] == list(quick_run.cases)
    comparison = quick_run.comparison("W1")
    assert comparison["baseline"] == "hand-written"
    assert [m["key"] for m in comparison["metrics"]] == ["step_time_s", "max_rss_bytes"]
    contenders = {c["name"]: c for c in comparison["contenders"]}
    assert list(contenders) == [
        "hand-written",
        "Lightning",
        "torchtnt",
        "Accelerate",
        "hand-written + the Trainer's work",
        "this project",
    ]
    for name in ("hand-written", "hand-written + the Trainer's work", "this project"):
        contender = contenders[name]
        assert contender["status"] == "ok", contender["note"]
        assert contender["num_runs"] == 1
        step_time = contender["metrics"]["step_time_s"]
        assert {"median", "min", "max", "ratio"} == set(step_time)
        assert step_time["min"] <= step_time["median"] <= step_time["max"]
        assert contender["metrics"]["max_rss_bytes"]["median"] > 0
    assert contenders["hand-written"]["metrics"]["step_time_s"]["ratio"] == 1.0
    for name in ("Lightning", "torchtnt", "Accelerate"):
        # A framework the environment lacks is skipped and says why, not a failure.
        assert contenders[name]["status"] in ("ok", "skipped"), contenders[name]["note"]

    table = (quick_run.output_dir / "results.md").read_text()
    assert "### W1: MLP 32-64-64-10, batch 32, 1 process" in table
    assert "| this project |" in table
    assert "vs hand-written" in table


@pytest.mark.parametrize(
    ("key", "names"),
    [
        ("W1-paired", [PAIRED]),
        # 2 ranks under torchrun, each taking the same turns, against both hand-written loops.
        pytest.param("W3-paired", [PAIRED, PAIRED_COUNTED], marks=pytest.mark.slow),
    ],
)
def test_the_paired_case_reports_both_steps_their_difference_and_ratio(
    request: pytest.FixtureRequest, tmp_path: Path, key: str, names: list[str]
) -> None:
    if key == "W1-paired":  # in the quick run the other tests share
        run: QuickRun = request.getfixturevalue("quick_run")
    else:
        run = QuickRun(run_quick_benchmark(key, tmp_path), tmp_path, (key,))
    assert_ok(run.result)
    comparison = run.comparison(key)
    contenders = comparison["contenders"]
    assert [contender["name"] for contender in contenders] == names
    for contender in contenders:
        assert contender["status"] == "ok", contender["note"]
        figures = contender["metrics"]
        assert set(figures) == {"trainer_step_s", "hand_step_s", "extra_s", "ratio"}
        trainer, hand = figures["trainer_step_s"]["median"], figures["hand_step_s"]["median"]
        assert trainer > 0 and hand > 0
        # Medians of per-block figures: the ratio is near that of the medians, not a fixed one.
        assert 0.5 < figures["ratio"]["median"] / (trainer / hand) < 2
    table = (run.output_dir / "results.md").read_text()
    assert "| Trainer step / hand-written step (median) |" in table


def test_bad_runs_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    # The suite's main in this process: the usage error comes before anything is imported or run.
    with pytest.raises(SystemExit) as exit_info:
        main(["--runs", "0"])
    assert exit_info.value.code == 2
    assert "error: --runs must be at least 1, but is 0 instead." in capsys.readouterr().err


@pytest.mark.slow
def test_the_lm_recipe_case_times_its_data_path_and_its_step(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    assert_ok(run_quick_benchmark("lm", tmp_path))
    comparisons = json.loads((tmp_path / "results.json").read_text())["comparisons"]
    assert [c["key"] for c in comparisons] == ["lm-data", "lm-step"]
    for comparison in comparisons:
        for contender in comparison["contenders"]:
            assert contender["status"] == "ok", contender["note"]
            assert contender["metrics"]["step_time_s"]["median"] > 0


@pytest.mark.slow
def test_the_text_data_case_reports_each_reader_by_dp_size(tmp_path: Path) -> None:
    assert_ok(run_quick_benchmark("text-data", tmp_path))
    results = json.loads((tmp_path / "results.json").read_text())
    by_key = {c["key"]: c for c in results["comparisons"]}
    assert list(by_key) == ["text-data-deliver", "text-data-prepare", "text-data-open"]
    deliver = {c["name"]: c for c in by_key["text-data-deliver"]["contenders"]}
    assert list(deliver) == ["prepared, DP=1", "prepared, DP=8", "text, DP=1", "text, DP=8"]
    for contender in [*deliver.values(), *by_key["text-data-prepare"]["contenders"]]:
        assert contender["status"] == "ok", contender["note"]
        assert contender["metrics"]["tokens_per_s"]["median"] > 0
