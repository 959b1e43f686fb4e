"""One process of the import-time comparison: how long ``import MODULE`` takes after torch.

``python -m benchmarks.import_worker MODULE`` prints ``import_s``, the time of ``import MODULE``
with torch already loaded (what the package costs on top of torch), and ``torch_import_s``.
With ``torch`` as MODULE, ``import_s`` is torch's own import time.
"""

from __future__ import annotations

import argparse
import importlib
import time

from benchmarks.probe import emit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module")
    args = parser.parse_args()
    start = time.perf_counter()
    importlib.import_module("torch")
    torch_done = time.perf_counter()
    if args.module != "torch":
        importlib.import_module(args.module)
    done = time.perf_counter()
    import_s = torch_done - start if args.module == "torch" else done - torch_done
    emit({"import_s": import_s, "torch_import_s": torch_done - start}, with_rss=False)


if __name__ == "__main__":
    main()
