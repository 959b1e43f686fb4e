"""The suite's output: ``results.json`` (every run's figures) and ``results.md`` (the tables)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SKIPPED_CELL = "n/a"


def format_value(value: float, unit: str) -> str:
    if unit == "bytes":
        return f"{value / 2**20:.0f} MiB"
    if unit == "count":
        return f"{value / 1e6:.3f} M" if value >= 1e6 else f"{value / 1e3:.1f} k"
    if unit == "ratio":
        return f"{value:.3f}x"
    if unit == "fraction":
        return f"{value:.1%}"
    if unit == "GB/s":
        return f"{value:.2f} GB/s"
    if value < 1e-3:
        return f"{value * 1e6:.0f} us"
    if value < 1.0:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s"


def format_ratio(ratio: float | None) -> str:
    return "" if ratio is None else f"{ratio:.2f}x"


def comparison_table(comparison: Mapping[str, Any]) -> list[str]:
    """One row per contender: each metric's median (or min), its range, and the ratio."""
    metrics = comparison["metrics"]
    header = ["contender"]
    for metric in metrics:
        header += [f"{metric['label']} ({metric['summary']})", "min - max"]
        if metric["ratio"]:
            header.append(f"vs {comparison['baseline']}")
    lines = [
        f"### {comparison['key']}: {comparison['title']}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for contender in comparison["contenders"]:
        cells = [contender["name"]]
        for metric in metrics:
            stats = contender["metrics"].get(metric["key"])
            width = 3 if metric["ratio"] else 2
            if stats is None:
                cells += [SKIPPED_CELL] * width
                continue
            unit = metric["unit"]
            cells += [
                format_value(stats[metric["summary"]], unit),
                f"{format_value(stats['min'], unit)} - {format_value(stats['max'], unit)}",
            ]
            if metric["ratio"]:
                cells.append(format_ratio(stats["ratio"]))
        lines.append("| " + " | ".join(cells) + " |")
    for contender in comparison["contenders"]:
        if contender["status"] != "ok":
            lines.append("")
            lines.append(f"- {contender['name']}: {contender['status']}: {contender['note']}")
    for note in comparison["notes"]:
        lines += ["", f"- {note}"]
    return [*lines, ""]


def summary_tables(comparisons: Sequence[Mapping[str, Any]]) -> list[str]:
    """The comparisons of each group (see :func:`_summary_groups`) of two or more, one row each,
    as ratios; a column for every contender any of them has (a case may add one of its own)."""
    lines: list[str] = []
    for members in _summary_groups(comparisons):
        if len(members) < 2:
            continue
        names = list(dict.fromkeys(c["name"] for m in members for c in m["contenders"]))
        metric = members[0]["metrics"][0]
        lines += [
            f"| {metric['label']} | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        for comparison in members:
            contenders = {c["name"]: c for c in comparison["contenders"]}
            cells = [f"{comparison['key']}: {comparison['title']}"]
            for name in names:
                stats = contenders[name]["metrics"].get(metric["key"]) if name in contenders else {}
                if stats is None:
                    cells.append(SKIPPED_CELL)
                elif not stats:
                    cells.append("")
                elif name == comparison["baseline"]:
                    cells.append(format_value(stats[metric["summary"]], metric["unit"]))
                else:
                    cells.append(format_ratio(stats["ratio"]))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _summary_groups(
    comparisons: Sequence[Mapping[str, Any]],
) -> list[list[Mapping[str, Any]]]:
    """Comparisons of the same first metric against the same baseline and with another contender
    in common, in the order of the suite."""
    groups: list[list[Mapping[str, Any]]] = []
    for comparison in comparisons:
        others = {c["name"] for c in comparison["contenders"]} - {comparison["baseline"]}
        for members in groups:
            first = members[0]
            if (
                first["metrics"][0]["key"] == comparison["metrics"][0]["key"]
                and first["baseline"] == comparison["baseline"]
                and others & {c["name"] for m in members for c in m["contenders"]}
            ):
                members.append(comparison)
                break
        else:
            groups.append([comparison])
    return groups


def markdown(results: Mapping[str, Any]) -> str:
    suite, machine = results["suite"], results["machine"]
    lines = [
        "## Benchmark results",
        "",
        f"`{suite['command']}`: {suite['runs']} run(s) per contender, alternating, each a fresh "
        f"process with one thread; {suite['started']} to {suite['finished']}.",
        "",
        f"Machine: {machine['cpu_count']} cores, {machine['platform']}, Python "
        f"{machine['python']}, torch {machine['torch']}; "
        + ", ".join(f"{name} {version}" for name, version in machine["frameworks"].items()),
        "",
        *summary_tables(results["comparisons"]),
    ]
    for comparison in results["comparisons"]:
        lines += comparison_table(comparison)
    return "\n".join(lines)


def write_results(results: Mapping[str, Any], output_dir: Path) -> tuple[Path, Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = output_dir / "results.json", output_dir / "results.md"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    md_path.write_text(markdown(results))
    return json_path, md_path
