"""One process (or rank) of the large-model comparisons (issue 9), built by the char-LM recipe.

``python -m benchmarks.large_model_worker {build,ac,compile} --on {0,1} [--quick]``:

- ``build``: peak RSS growth while ``build_model`` makes a dim-1024, 8-layer model (about 110M
  parameters) under FSDP2, on ``meta`` (``--on 1``) or whole (run it under ``torchrun``);
- ``ac``: peak RSS growth of one forward and backward of 4 x 2048 bytes (dim 256, 4 layers),
  with activation checkpointing on every block (``--on 1``) or without;
- ``compile``: the W2 model's step time, compiled block by block with the loss (``--on 1``) or
  eager, and the first step's time, which holds the compilation.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable

import torch

from benchmarks.probe import emit, exit_now, use_one_thread
from gangs import setup_gangs
from recipes.char_lm import CharLMConfig, build_model
from runtime import compile_loss
from units.lm import summed_nll_loss


def rss_bytes() -> float:
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def make_config(*, dim: int, num_layers: int, seq_len: int) -> CharLMConfig:
    config = CharLMConfig()
    config.model.dim, config.model.num_layers = dim, num_layers
    config.model.num_heads, config.model.ffn_dim = max(1, dim // 64), 4 * dim
    config.data.seq_len = seq_len
    return config


def build(on: bool, quick: bool) -> dict[str, float]:
    config = make_config(dim=512 if quick else 1024, num_layers=8, seq_len=128)
    config.model.meta_init, config.data_parallel = on, "fsdp"
    gangs = setup_gangs(tp_size=1)
    before = rss_bytes()
    build_model(config, gangs)
    return {"rss_growth_bytes": rss_bytes() - before}


def activation_checkpointing(on: bool, quick: bool) -> dict[str, float]:
    seq_len = 512 if quick else 2048
    config = make_config(dim=256, num_layers=4, seq_len=seq_len)
    config.model.activation_checkpointing = on
    model = build_model(config, setup_gangs(tp_size=1))
    tokens = torch.randint(0, 256, (4, seq_len + 1))
    before = rss_bytes()
    summed_nll_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    return {"rss_growth_bytes": rss_bytes() - before}


def compiled_steps(on: bool, quick: bool) -> dict[str, float]:
    config = make_config(dim=128, num_layers=2, seq_len=128)
    config.model.num_heads, config.model.ffn_dim, config.compile = 4, 512, on
    model = build_model(config, setup_gangs(tp_size=1))
    loss_fn = compile_loss(summed_nll_loss) if on else summed_nll_loss
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (16, 129))

    def step() -> float:
        start = time.perf_counter()
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    first_step_s = step()
    for _ in range(3):
        step()
    timed = [step() for _ in range(3 if quick else 20)]
    return {"step_time_s": sum(timed) / len(timed), "first_step_s": first_step_s}


MODES: dict[str, Callable[[bool, bool], dict[str, float]]] = {
    "build": build,
    "ac": activation_checkpointing,
    "compile": compiled_steps,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=tuple(MODES))
    parser.add_argument("--on", type=int, choices=(0, 1), required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    use_one_thread()
    emit(MODES[args.mode](bool(args.on), args.quick), with_rss=False)
    exit_now()


if __name__ == "__main__":
    main()
