"""Every model family of tests/recipes/families.py trained a few steps through ``recipes.lm``
in its quick layout, all in one launch of 2 ranks, for tests/recipes/test_families.py.

Usage: ``lm_families.py DIR STEPS [FAMILY ...]`` (default: every family with a quick layout). ``DIR`` holds ``train.jsonl``, ``valid.jsonl`` and one model
directory per family (``DIR/<slug>/model``); each family's run goes to ``DIR/<slug>/run``. The
2-rank layouts a family is refused in are built too, and rank 0 writes the errors to
``DIR/refusals.json``: ``{"<family>/<layout>": "message"}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gangs import setup_parallel_gangs, setup_root_gang
from recipes.lm import LMConfig, build_trainer
from runtime.cli.config import load_config
from tests.recipes.families import FAMILIES, LAYOUT_BY_NAME, LAYOUTS, Layout, run_config
from tests.workers.leave import leave


def config_of(directory: Path, slug: str, layout: Layout, steps: int) -> LMConfig:
    overrides = run_config(
        directory / slug / "model", directory / "train.jsonl", directory / "valid.jsonl", layout
    )
    # A validation at the end; no checkpoint (the matrix of test-all resumes every family).
    checkpoints = f"trainer.checkpoint_every_n_steps={1000 * steps}"
    validation = f"trainer.validate_every_n_steps={steps}"
    return load_config(
        LMConfig,
        overrides=[*overrides, f"trainer.max_num_steps={steps}", checkpoints, validation],
    )


def main(directory: Path, steps: int, names: list[str]) -> None:
    root = setup_root_gang()
    families = [family for family in FAMILIES if not names or family.name in names]
    for family in families:
        if family.quick_layout is None:
            continue
        layout = LAYOUT_BY_NAME[family.quick_layout]
        config = config_of(directory, family.slug, layout, steps)
        gangs = setup_parallel_gangs(root, tp_size=config.gang.tp_size)
        trainer = build_trainer(config, directory / family.slug / "run", gangs)
        trainer.run()
        trainer.close()
    refusals = {}
    for family in families:
        for layout in LAYOUTS:
            if layout.name not in family.refused or layout.nproc != root.size:
                continue
            config = config_of(directory, family.slug, layout, steps)
            gangs = setup_parallel_gangs(root, tp_size=config.gang.tp_size)
            try:
                build_trainer(config, directory / family.slug / "refused", gangs)
            except ValueError as ex:
                refusals[f"{family.name}/{layout.name}"] = str(ex)
    if root.rank == 0:
        (directory / "refusals.json").write_text(json.dumps(refusals))
    leave(root)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
