"""The char-LM model built the large-model way under ``torchrun``, for tests/runtime/test_large_models.

Usage: ``large_model.py OUTPUT_DIR JSON_OPTIONS``. Options: ``mode`` (below), ``tp_size``,
``dp_shard_size``, ``data_parallel`` (``auto``, ``ddp``, ``fsdp``, ``hsdp``), ``meta_init``.
With ``{"cases": {NAME: OPTIONS, ...}}`` it runs each case in turn in one launch (one torchrun
start-up), writing into ``OUTPUT_DIR/NAME``.

- ``init``: build and materialize the model; rank 0 writes ``init.pt``: ``{"weights": the full
  state dict, "loss": the loss of one forward on the same tokens on every rank}`` (the forward
  shows that the parallel wrappers compute with the materialized values).
- ``ac_grads``: one forward and backward on rank-dependent tokens, without and then with
  activation checkpointing on every block; rank 0 writes both full gradient sets to
  ``grads.pt`` as ``{"plain": ..., "checkpointed": ..., "num_checkpointed": n}``.
- ``mixed_precision``: FSDP2 with ``param_dtype`` bfloat16 and ``reduce_dtype`` float32, one
  forward and backward; rank 0 writes the dtypes it saw to ``mixed_precision.pt``: of the
  sharded parameters, of a weight during the forward, of the loss and of the gradients.
- ``compile``: ``num_steps`` AdamW steps, eager and then with every block and the loss compiled;
  rank 0 writes both full state dicts to ``compiled.pt`` as ``{"eager": ..., "compiled": ...}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from gangs import Gang, Gangs, setup_parallel_gangs, setup_root_gang
from recipes.char_lm import Block, CharLMConfig, build_model
from runtime import apply_activation_checkpointing, compile_loss
from tests.workers.leave import leave
from units.lm import summed_nll_loss

SEQ_LEN = 16


def make_config(options: dict[str, Any]) -> CharLMConfig:
    config = CharLMConfig()
    config.model.dim = 16
    config.model.num_heads = 4
    config.model.ffn_dim = 24
    config.model.num_layers = 2
    config.model.dropout = options.get("dropout", 0.0)
    config.model.meta_init = options.get("meta_init", True)
    config.data.seq_len = SEQ_LEN
    config.gang.tp_size = options.get("tp_size", 1)
    config.gang.dp_shard_size = options.get("dp_shard_size")
    config.data_parallel = options.get("data_parallel", "auto")
    config.trainer.seed = 7
    return config


def full_state(model: nn.Module) -> dict[str, Tensor]:
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {k: v for k, v in state.items() if isinstance(v, Tensor)}


def full_grads(model: nn.Module) -> dict[str, Tensor]:
    grads = {}
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        grad = param.grad
        grads[name.removeprefix("module.")] = (
            grad.full_tensor() if isinstance(grad, DTensor) else grad
        ).clone()
    return grads


def tokens(gangs: Gangs, step: int) -> Tensor:
    # Each DP rank its own batch; the TP ranks of a DP rank share it.
    gen = torch.Generator().manual_seed(1000 * step + gangs.dp.rank)
    return torch.randint(0, 256, (2, SEQ_LEN + 1), generator=gen)


def backward(model: nn.Module, gangs: Gangs, step: int, loss_fn: Any = summed_nll_loss) -> None:
    batch = tokens(gangs, step)
    torch.manual_seed(11 + step)  # the same dropout masks in both runs
    loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()


def ac_grads(config: CharLMConfig, gangs: Gangs) -> dict[str, Any]:
    plain = build_model(config, gangs)
    backward(plain, gangs, 0)
    checkpointed = build_model(config, gangs)
    count = apply_activation_checkpointing(checkpointed, block_types=(Block,))
    backward(checkpointed, gangs, 0)
    return {
        "plain": full_grads(plain),
        "checkpointed": full_grads(checkpointed),
        "num_checkpointed": count,
    }


def mixed_precision(config: CharLMConfig, gangs: Gangs) -> dict[str, str]:
    config.fsdp.param_dtype, config.fsdp.reduce_dtype = "bfloat16", "float32"
    model = build_model(config, gangs)
    seen: dict[str, str] = {}
    wq = model.blocks[0].attn.wq  # type: ignore[index, union-attr]

    def record(module: nn.Module, args: Any, output: Tensor) -> None:
        seen["forward_weight"] = str(module.weight.dtype)
        seen["forward_output"] = str(output.dtype)

    wq.register_forward_hook(record)
    backward(model, gangs, 0)
    seen["sharded_param"] = str(wq.weight.dtype)
    assert wq.weight.grad is not None
    seen["grad"] = str(wq.weight.grad.dtype)
    return seen


def train(config: CharLMConfig, gangs: Gangs, num_steps: int) -> dict[str, Tensor]:
    model = build_model(config, gangs)
    loss_fn = compile_loss(summed_nll_loss) if config.compile else summed_nll_loss
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(num_steps):
        optimizer.zero_grad()
        backward(model, gangs, step, loss_fn)
        optimizer.step()
    return full_state(model)


def run_case(output_dir: Path, root: Gang, options: dict[str, Any]) -> None:
    config = make_config(options)
    gangs = setup_parallel_gangs(
        root, tp_size=config.gang.tp_size, dp_shard_size=config.gang.dp_shard_size
    )
    mode = options["mode"]
    result: Any
    if mode == "init":
        model = build_model(config, gangs)
        batch = torch.randint(0, 256, (2, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            loss = summed_nll_loss(model(batch[:, :-1]), batch[:, 1:])
        result = {"weights": full_state(model), "loss": loss.item()}
    elif mode == "ac_grads":
        result = ac_grads(config, gangs)
    elif mode == "mixed_precision":
        result = mixed_precision(config, gangs)
    else:
        num_steps = options.get("num_steps", 3)
        eager = train(config, gangs, num_steps)
        config.compile = True
        result = {"eager": eager, "compiled": train(config, gangs, num_steps)}
    if gangs.root.rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        torch.save(result, output_dir / f"{mode}.pt")


def run_all(root: Gang, output_dir: Path, cases: dict[str, dict[str, Any]]) -> None:
    """Each of ``cases`` in turn, into ``output_dir/NAME``."""
    for name, case_options in cases.items():
        try:
            run_case(output_dir / name, root, case_options)
        except BaseException as ex:
            ex.add_note(f"(in large_model.py's case {name})")
            raise


def main(output_dir: Path, options: dict[str, Any]) -> None:
    root = setup_root_gang()
    run_all(root, output_dir, options.get("cases", {".": options}))
    leave(root)


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
