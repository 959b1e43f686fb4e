"""Large-model figures (issue 9): meta-init memory, activation-checkpointing memory, compile.

``python -m benchmarks.large_models [memory|ac|compile]...`` (default: all three), from the repo
root with ``src`` on ``PYTHONPATH``. Each measurement runs in fresh processes, since CPU peak
memory is the process's peak resident set (``ru_maxrss``), which never goes down:

- ``memory``: per-rank peak RSS growth while building the char-LM model (dim 1024, 8 layers,
  about 110M parameters, 440 MB in float32) under FSDP2 on 2 ranks, on ``meta`` and whole;
- ``ac``: peak RSS growth of one forward and backward on a long sequence (4 x 2048 bytes, dim 256,
  4 layers) with and without activation checkpointing on every block, one process;
- ``compile``: W2 (the recipe's default model, 16 x 128 targets a step, AdamW, one process):
  eager and compiled (every block and the loss) mean step time over 20 steps after warm-up,
  and the compile time (the first compiled step's extra time).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _config(dim: int, layers: int, seq_len: int) -> Any:
    from recipes.char_lm import CharLMConfig

    config = CharLMConfig()
    config.model.dim, config.model.num_layers = dim, layers
    config.model.num_heads, config.model.ffn_dim = max(1, dim // 64), 4 * dim
    config.data.seq_len = seq_len
    return config


def _memory_worker(meta: bool) -> dict[str, Any]:
    from gangs import setup_gangs
    from recipes.char_lm import build_model

    gangs = setup_gangs()
    config = _config(1024, 8, 128)
    config.model.meta_init = meta
    config.data_parallel = "fsdp"
    before = _peak_rss_bytes()
    model = build_model(config, gangs)
    num_params = sum(p.numel() for p in model.parameters())  # global sizes (DTensor)
    growth = _peak_rss_bytes() - before
    gangs.root.close()
    return {"rank": gangs.root.rank, "params": num_params, "peak_growth_mb": growth / 2**20}


def _loss(model: Any, tokens: torch.Tensor, loss_fn: Any) -> torch.Tensor:
    result: torch.Tensor = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    return result


def _ac_worker(checkpointing: bool) -> dict[str, Any]:
    from gangs import Gangs
    from recipes.char_lm import build_model, summed_nll_loss

    config = _config(256, 4, 2048)
    config.model.activation_checkpointing = checkpointing
    model = build_model(config, Gangs.single())
    tokens = torch.randint(0, 256, (4, 2049))
    before = _peak_rss_bytes()
    _loss(model, tokens, summed_nll_loss).backward()
    return {"checkpointing": checkpointing, "peak_growth_mb": (_peak_rss_bytes() - before) / 2**20}


def _compile_worker(compiled: bool) -> dict[str, Any]:
    from gangs import Gangs
    from recipes.char_lm import build_model, summed_nll_loss
    from runtime import compile_loss

    config = _config(128, 2, 128)
    config.model.num_heads, config.model.ffn_dim = 4, 512
    config.compile = compiled
    model = build_model(config, Gangs.single())
    loss_fn = compile_loss(summed_nll_loss) if compiled else summed_nll_loss
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (16, 129))

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad()
        _loss(model, tokens, loss_fn).backward()
        optimizer.step()
        return time.perf_counter() - start

    first = step()
    for _ in range(3):
        step()
    times = [step() for _ in range(20)]
    mean = sum(times) / len(times)
    return {"compiled": compiled, "first_step_s": first, "step_ms": 1000 * mean}


def _run(args: list[str], nproc: int = 1) -> list[dict[str, Any]]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "src")])
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    result = subprocess.run(
        [*launcher, __file__, "--worker", *args],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def main(which: list[str]) -> None:
    if "memory" in which:
        for meta in (True, False):
            rows = sorted(_run(["memory", str(int(meta))], nproc=2), key=lambda r: r["rank"])
            growth = ", ".join(f"{row['peak_growth_mb']:.0f}" for row in rows)
            print(
                f"build {rows[0]['params'] / 1e6:.0f}M params under FSDP2 on 2 ranks, "
                f"{'meta' if meta else 'whole'}: per-rank peak RSS growth {growth} MB"
            )
    if "ac" in which:
        for checkpointing in (False, True):
            (row,) = _run(["ac", str(int(checkpointing))])
            label = "with" if checkpointing else "without"
            print(
                f"forward+backward of 4 x 2048 bytes {label} activation checkpointing: "
                f"peak RSS growth {row['peak_growth_mb']:.0f} MB"
            )
    if "compile" in which:
        eager, compiled = (_run(["compile", str(int(c))])[0] for c in (False, True))
        compile_s = compiled["first_step_s"] - eager["first_step_s"]
        print(
            f"W2 step: eager {eager['step_ms']:.1f} ms, compiled {compiled['step_ms']:.1f} ms; "
            f"compile time {compile_s:.1f} s"
        )


def _worker(kind: str, flag: str) -> None:
    workers = {"memory": _memory_worker, "ac": _ac_worker, "compile": _compile_worker}
    print(json.dumps(workers[kind](bool(int(flag)))))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1:] or ["memory", "ac", "compile"])
