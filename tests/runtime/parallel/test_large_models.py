"""Large models: meta-device init that does not depend on the layout, activation checkpointing,
block-wise compilation, under real torchrun processes (tests/workers/large_model.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gangs import Gangs
from recipes.char_lm import Block, ByteTransformer, ModelSection
from runtime import (
    apply_activation_checkpointing,
    apply_data_parallel,
    has_meta_tensors,
    materialize_model,
)
from tests.conftest import RunTorch, assert_ok, needs_cpp_compiler, torchrun

WORKER = "tests/workers/large_model.py"


def run_worker(run_torchrun: RunTorch, out: Path, nproc: int, **options: Any) -> Any:
    assert_ok(run_torchrun(nproc, WORKER, str(out), json.dumps(options)))
    return torch.load(out / f"{options['mode']}.pt", weights_only=True)


INIT_LAYOUTS = {
    "ddp2": (2, {"data_parallel": "ddp"}),
    "fsdp2": (2, {"data_parallel": "fsdp"}),
    "fsdp2_built_whole": (2, {"data_parallel": "fsdp", "meta_init": False}),
    "tp2": (2, {"tp_size": 2}),
    "dp2_x_tp2": (4, {"tp_size": 2}),
    "hsdp2x2": (4, {"dp_shard_size": 2}),
}

# Every two-process case of this file, run in the shared two-rank launch: name to options.
TWO_PROCESS_CASES: dict[str, dict[str, Any]] = {
    **{
        f"init-{layout}": {"mode": "init", **options}
        for layout, (nproc, options) in INIT_LAYOUTS.items()
        if nproc == 2
    },
    **{
        f"ac_grads-{kind}": {"mode": "ac_grads", "data_parallel": kind, "dropout": 0.1}
        for kind in ("ddp", "fsdp")
    },
    "mixed_precision": {"mode": "mixed_precision", "data_parallel": "fsdp"},
}


@pytest.fixture(scope="module")
def two_processes(two_rank_checks: Path) -> Any:
    """``two_processes(case)``: what rank 0 wrote for a case of :data:`TWO_PROCESS_CASES`, run
    in the shared two-rank launch (tests/workers/two_rank_checks.py)."""
    out = two_rank_checks / "large_model"

    def get(case: str) -> Any:
        mode = TWO_PROCESS_CASES[case]["mode"]
        return torch.load(out / case / f"{mode}.pt", weights_only=True)

    return get


def assert_close_dicts(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


# ------------------------------------------------------------------- initialization


@pytest.fixture(scope="module")
def single_process_init(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    result: dict[str, Any] = run_worker(
        torchrun, tmp_path_factory.mktemp("init_dp1"), 1, mode="init"
    )
    return result


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout",
    [
        # `make test`: the two-process layouts, which share one launch; `make test-all`: also
        # those of four processes.
        layout if nproc == 2 else pytest.param(layout, marks=pytest.mark.slow)
        for layout, (nproc, _) in INIT_LAYOUTS.items()
    ],
)
def test_initial_weights_depend_on_the_seed_alone(
    run_torchrun: RunTorch,
    tmp_path: Path,
    two_processes: Any,
    single_process_init: dict[str, Any],
    layout: str,
) -> None:
    nproc, options = INIT_LAYOUTS[layout]
    if nproc == 2:
        result = two_processes(f"init-{layout}")
    else:
        result = run_worker(run_torchrun, tmp_path, nproc, mode="init", **options)
    weights, expected = result["weights"], single_process_init["weights"]
    assert weights.keys() == expected.keys()
    different = [k for k in weights if not torch.equal(weights[k], expected[k])]
    assert not different, f"{layout}: not bit-identical to DP=1: {different}"
    # The sharded model computes with those weights (TP sums partial results: float tolerance).
    assert result["loss"] == pytest.approx(single_process_init["loss"], rel=1e-5)


def test_materialized_weights_follow_reset_parameters_over_the_full_shape() -> None:
    config = ModelSection(dim=16, num_heads=4, ffn_dim=24, num_layers=2)
    with torch.device("meta"):
        model = ByteTransformer(config, 8)
    assert has_meta_tensors(model)
    materialize_model(model, device=torch.device("cpu"), seed=3)
    assert not has_meta_tensors(model)
    # nn.Linear's kaiming-uniform bound is 1/sqrt(fan_in): 1/sqrt(16) for wo, 1/sqrt(24) for w2.
    wo = model.blocks[0].attn.wo.weight
    assert 0.2 < wo.abs().max().item() <= 0.25
    assert model.blocks[1].ffn.w2.weight.abs().max().item() <= 24**-0.5
    assert torch.equal(model.blocks[0].attn_norm.weight, torch.ones(16))
    # Blocks of the same shape get different values: the seed includes the module's name.
    assert not torch.equal(model.blocks[0].attn.wq.weight, model.blocks[1].attn.wq.weight)

    with torch.device("meta"):
        again = ByteTransformer(config, 8)
    materialize_model(again, device=torch.device("cpu"), seed=3)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True)
    )
    materialize_model(again, device=torch.device("cpu"), seed=4)
    assert not torch.equal(model.embed.weight, again.embed.weight)


def test_a_module_without_reset_parameters_is_a_clear_error() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(ValueError, match=r"Module '1' \(Scale\) .* no reset_parameters\(\)"):
        materialize_model(model, device=torch.device("cpu"), seed=0)

    def init_fn(name: str, module: nn.Module) -> None:
        if isinstance(module, Scale):
            nn.init.ones_(module.gain)
        else:
            module.reset_parameters()  # type: ignore[operator]

    materialize_model(model, device=torch.device("cpu"), seed=0, init_fn=init_fn)
    assert torch.equal(model[1].gain, torch.ones(3))


# ---------------------------------------------------------------- activation checkpointing


def test_activation_checkpointing_keeps_names_and_gradients() -> None:
    torch.manual_seed(0)
    config = ModelSection(dim=16, num_heads=4, ffn_dim=24, num_layers=4, dropout=0.1)
    model = ByteTransformer(config, 8)
    reference = ByteTransformer(config, 8)
    reference.load_state_dict(model.state_dict())
    assert apply_activation_checkpointing(model, block_types=(Block,), every_n=2) == 2
    assert model.state_dict().keys() == reference.state_dict().keys()
    tokens = torch.randint(0, 256, (2, 8))
    for module in (model, reference):
        torch.manual_seed(5)
        module(tokens).square().sum().backward()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert param.grad is not None and ref.grad is not None
        torch.testing.assert_close(param.grad, ref.grad, msg=name)
    with pytest.raises(ValueError, match="every_n must be greater than zero, but is 0"):
        apply_activation_checkpointing(model, block_types=(Block,), every_n=0)


@pytest.mark.distributed
@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_activation_checkpointing_gives_the_same_gradients(
    two_processes: Any, data_parallel: str
) -> None:
    result = two_processes(f"ac_grads-{data_parallel}")
    assert result["num_checkpointed"] == 2
    assert_close_dicts(result["checkpointed"], result["plain"])
    assert any(grad.abs().sum() > 0 for grad in result["plain"].values())


# -------------------------------------------------------------------- mixed precision


@pytest.mark.distributed
def test_fsdp2_mixed_precision_computes_in_bf16_and_keeps_fp32_weights(
    two_processes: Any,
) -> None:
    seen = two_processes("mixed_precision")
    assert seen == {
        "forward_weight": "torch.bfloat16",
        "forward_output": "torch.bfloat16",
        "sharded_param": "torch.float32",
        "grad": "torch.float32",
    }


def test_fsdp2_on_one_process_shards_over_a_mesh_of_one_in_mixed_precision(
    gangs_with_mesh_of_one: Gangs,
) -> None:
    """``data_parallel=fsdp`` on one process: DTensor parameters on a mesh of one, kept in
    float32, computed in bf16, with float32 gradients near the unsharded model's."""
    from torch.distributed.tensor import DTensor, Shard

    from recipes.char_lm import build_model
    from tests.workers.large_model import backward, full_grads, make_config

    gangs = gangs_with_mesh_of_one
    config = make_config({"data_parallel": "fsdp"})
    config.fsdp.param_dtype, config.fsdp.reduce_dtype = "bfloat16", "float32"
    sharded = build_model(config, gangs)
    for name, param in sharded.named_parameters():
        assert isinstance(param, DTensor) and param.dtype == torch.float32, name
        assert param.device_mesh == gangs.dp_mesh and param.placements == (Shard(0),), name
    seen: list[torch.dtype] = []
    wq = sharded.blocks[0].attn.wq  # type: ignore[index, union-attr]
    wq.register_forward_hook(
        lambda module, args, out: seen.extend([module.weight.dtype, out.dtype])
    )
    plain = build_model(make_config({"data_parallel": "ddp"}), Gangs.single())
    backward(sharded, gangs, 0)
    backward(plain, Gangs.single(), 0)
    assert seen == [torch.bfloat16, torch.bfloat16]  # gathered and computed in bf16
    assert wq.weight.grad is not None and wq.weight.grad.dtype == torch.float32
    expected = full_grads(plain)
    for name, grad in full_grads(sharded).items():
        # bf16 keeps 8 bits of mantissa: the gradients agree to about 1%.
        error = (grad - expected[name]).norm() / expected[name].norm()
        assert error < 0.03, (name, float(error))


def test_hsdp_on_one_process_replicates_and_shards_over_a_mesh_of_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from gangs import setup_gangs

    monkeypatch.setenv("WORLD_SIZE", "1")
    gangs = setup_gangs(device=torch.device("cpu"), dp_shard_size=1, force_process_group=True)
    try:
        model = apply_data_parallel(nn.Linear(4, 4), gangs, kind="hsdp")
        assert isinstance(model.weight, DTensor)
        assert model.weight.placements == (Replicate(), Shard(0))
        assert model.weight.device_mesh == gangs.hsdp_mesh
    finally:
        gangs.root.close()
    assert not dist.is_initialized()


def test_mixed_precision_without_a_mesh_is_refused_on_one_process() -> None:
    with pytest.raises(ValueError, match=r"setup_gangs\(force_process_group=True\)"):
        apply_data_parallel(
            nn.Linear(2, 2), Gangs.single(), kind="fsdp", param_dtype=torch.bfloat16
        )


def test_mixed_precision_is_rejected_with_ddp() -> None:
    with pytest.raises(ValueError, match="are FSDP2 options, but kind is 'ddp'"):
        apply_data_parallel(nn.Linear(2, 2), Gangs.single(), kind="ddp", param_dtype=torch.bfloat16)


# ---------------------------------------------------------------------------- compile


@pytest.mark.slow
@pytest.mark.distributed
def test_compiled_ddp_run_matches_eager(run_torchrun: RunTorch, tmp_path: Path) -> None:
    needs_cpp_compiler()
    result = run_worker(run_torchrun, tmp_path, 2, mode="compile", data_parallel="ddp")
    assert_close_dicts(result["compiled"], result["eager"])


@pytest.mark.slow
@pytest.mark.distributed
def test_compiled_fsdp2_with_tp_run_matches_eager(run_torchrun: RunTorch, tmp_path: Path) -> None:
    needs_cpp_compiler()
    result = run_worker(run_torchrun, tmp_path, 4, mode="compile", tp_size=2)
    assert_close_dicts(result["compiled"], result["eager"])
