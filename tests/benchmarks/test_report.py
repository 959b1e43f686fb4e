"""The summary table of the suite's Markdown."""

from __future__ import annotations

from typing import Any

from benchmarks.report import format_value, summary_tables

STEP_TIME = {"key": "step_time_s", "label": "step time", "unit": "s", "summary": "median"}


def comparison(key: str, contenders: dict[str, float | None]) -> dict[str, Any]:
    """A comparison whose first contender is the baseline; None marks a skipped contender."""
    baseline = next(iter(contenders))
    return {
        "key": key,
        "title": f"workload {key}",
        "baseline": baseline,
        "metrics": [STEP_TIME],
        "contenders": [
            {
                "name": name,
                "metrics": {}
                if seconds is None
                else {"step_time_s": {"median": seconds, "ratio": seconds / contenders[baseline]}},
            }
            for name, seconds in contenders.items()
        ],
    }


def test_a_case_with_a_contender_of_its_own_stays_in_the_summary_with_a_column_for_it() -> None:
    lines = summary_tables(
        [
            comparison("W1", {"hand": 0.001, "Lightning": 0.002, "hand+": 0.0011, "ours": 0.0012}),
            comparison("W3", {"hand": 0.003, "Lightning": None, "ours": 0.0033}),
            comparison("data", {"hand": 0.007, "prefetch": 0.0045}),
        ]
    )
    assert lines == [
        "| step time | hand | Lightning | hand+ | ours |",
        "|---|---|---|---|---|",
        "| W1: workload W1 | 1.0 ms | 2.00x | 1.10x | 1.20x |",
        "| W3: workload W3 | 3.0 ms | n/a |  | 1.10x |",
        "",
    ]


def test_a_comparison_sharing_nothing_but_metric_and_baseline_has_no_summary() -> None:
    assert summary_tables([comparison("W1", {"hand": 0.001, "ours": 0.0012})]) == []
    assert (
        summary_tables(
            [
                comparison("A", {"whole": 0.001, "on meta": 0.0005}),
                comparison("B", {"without": 0.002, "every block": 0.001}),
            ]
        )
        == []
    )


def test_counts_read_in_millions_or_thousands() -> None:
    assert format_value(2_317_773.0, "count") == "2.318 M"
    assert format_value(5_300.0, "count") == "5.3 k"
