"""Two GPUs over nccl: DDP, FSDP2 and TP train to the weights of one GPU with the same global
batch, the char-LM recipe shards with FSDP2 in bf16, and a checkpoint of two GPUs resumes on one
(resharded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import assert_ok, read_jsonl
from tests.cuda.conftest import CUDA_SUITE, TWO_GPUS, load_params, run_char_lm, run_cuda_run
from tests.faults.jobs import committed

pytestmark = [*CUDA_SUITE, TWO_GPUS]

# Dropout off: its masks depend on how the ranks split the batch. SGD: a wrong gradient scale
# across the ranks changes the weights.
RUN = ("max_num_steps=12", "dropout=0.0", "checkpoint_every=6", "sgd=true")


@pytest.fixture(scope="module")
def one_gpu_params(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """One GPU, 32 examples a step: the weights every layout must reach."""
    out = tmp_path_factory.mktemp("one_gpu") / "run"
    assert_ok(run_cuda_run(out, *RUN, "batch_size=32"))
    return load_params(out)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(("kind=ddp", "batch_size=16"), id="ddp"),
        pytest.param(("kind=fsdp", "batch_size=16"), id="fsdp2"),
        # TP: both ranks see the same 32 examples and each computes half of the hidden units.
        pytest.param(("tp_size=2", "batch_size=32"), id="tp"),
    ],
)
def test_two_gpus_train_to_the_weights_of_one(
    tmp_path: Path, one_gpu_params: dict[str, torch.Tensor], layout: tuple[str, ...]
) -> None:
    out = tmp_path / "run"
    assert_ok(run_cuda_run(out, *RUN, *layout, nproc=2))
    params = load_params(out)
    assert params.keys() == one_gpu_params.keys()
    for name, expected in one_gpu_params.items():
        # The gradients are summed in another order across two GPUs: close, not equal.
        torch.testing.assert_close(params[name], expected, rtol=1e-4, atol=1e-5, msg=name)


def test_the_char_lm_recipe_learns_with_fsdp2_in_bf16_on_two_gpus(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert_ok(
        run_char_lm(
            out,
            "data_parallel=fsdp",
            "fsdp.param_dtype=bfloat16",
            "trainer.max_num_steps=60",
            nproc=2,
        )
    )
    train = read_jsonl(out / "metrics" / "train.jsonl")
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    assert train[-1]["loss"] < 3.6


def test_a_checkpoint_of_two_gpus_resumes_on_one(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert_ok(run_cuda_run(out, *RUN, "kind=fsdp", "batch_size=16", "max_num_steps=6", nproc=2))
    assert committed(out) == [6]
    assert_ok(run_cuda_run(out, *RUN, "batch_size=32", "reshard_on_resume=true"))
    assert "from the checkpoint of step 6." in (out / "logs" / "rank_0.log").read_text()
    assert committed(out) == [6, 12]
    params = load_params(out)
    assert all(torch.isfinite(value).all() for value in params.values())
