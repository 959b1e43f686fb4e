"""Import time of this project's packages and of the frameworks, on top of ``import torch``."""

from __future__ import annotations

import importlib.util

from benchmarks.cases.base import SuiteSettings
from benchmarks.runner import Comparison, Contender, Metric

KEY = "import"
MODULES = (
    ("torch", "torch"),
    ("runtime", "runtime"),
    ("checkpoint", "checkpoint"),
    ("units", "units"),
    ("gangs", "gangs"),
    ("Lightning", "lightning"),
    ("torchtnt", "torchtnt.framework"),
    ("Accelerate", "accelerate"),
)


def _skip_reason(module: str) -> str | None:
    package = module.split(".")[0]
    if importlib.util.find_spec(package) is not None:
        return None
    return f"{package} is not installed (pip install -e '.[bench]')"


def comparisons(settings: SuiteSettings) -> list[Comparison]:
    del settings
    return [
        Comparison(
            key=KEY,
            title="import time over `import torch` (min of the runs)",
            baseline="torch",
            metrics=(Metric("import_s", "import", "s", summary="min", ratio=False),),
            contenders=tuple(
                Contender(
                    name=f"import {name}" if name != "torch" else "torch",
                    module="benchmarks.import_worker",
                    args=(module,),
                    skip_reason=_skip_reason(module),
                )
                for name, module in MODULES
            ),
            notes=("The torch row is torch's own import time; the others come on top of it.",),
        )
    ]
