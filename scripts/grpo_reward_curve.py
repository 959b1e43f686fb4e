"""Run the GRPO learning test's task and plot its mean reward per step as an SVG.

Usage: ``PYTHONPATH=src:. python scripts/grpo_reward_curve.py docs/figures/grpo-reward.svg``
(about 30 s on one CPU core). The run is ``tests/recipes/test_grpo.py``'s ``learning_run``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tests.recipes.test_grpo import learning_run

WIDTH, HEIGHT, MARGIN = 480, 240, 40


def svg(rewards: list[float]) -> str:
    n = len(rewards)

    def x(i: int) -> float:
        return MARGIN + i * (WIDTH - 2 * MARGIN) / max(1, n - 1)

    def y(r: float) -> float:
        return HEIGHT - MARGIN - r * (HEIGHT - 2 * MARGIN)

    points = " ".join(f"{x(i):.1f},{y(r):.1f}" for i, r in enumerate(rewards))
    ticks = "".join(
        f'<text x="{MARGIN - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.1f}</text>'
        f'<line x1="{MARGIN}" x2="{WIDTH - MARGIN}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
        'stroke="#ddd"/>'
        for v in (0.0, 0.5, 1.0)
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        'font-family="sans-serif" font-size="11">'
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>{ticks}'
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{points}"/>'
        f'<text x="{WIDTH / 2}" y="{HEIGHT - 8}" text-anchor="middle">step (1 to {n})</text>'
        f'<text x="{WIDTH / 2}" y="16" text-anchor="middle">GRPO, tiny Llama: mean reward '
        "(answer with the named word)</text></svg>\n"
    )


def main(path: Path) -> None:
    with tempfile.TemporaryDirectory() as directory:
        rewards = [r["reward"] for r in learning_run(Path(directory))]
    path.write_text(svg(rewards))
    print(" ".join(f"{r:.2f}" for r in rewards))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
