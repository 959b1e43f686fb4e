"""``data_parallel=fsdp`` on one process is FSDP2: ``recipes.lm`` shards over a mesh of one,
applies the mixed precision it is given, trains as the unsharded run does, and its checkpoint
resumes on two processes (resharded)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import recipes.lm.model
from recipes.lm import LMConfig
from runtime import main
from runtime.parallel.wrapping import fsdp_param_dtype
from tests.conftest import assert_ok, read_jsonl, torchrun
from tests.recipes.test_families import BF16_RTOL
from tests.recipes.test_lm import TINY_TRAINING, last_model, losses, repeated

BF16_FSDP = ("data_parallel=fsdp", "fsdp.param_dtype=bfloat16", "fsdp.reduce_dtype=float32")


def lm_config(tmp_path: Path, *extra: str) -> list[str]:
    train = tmp_path / "train.jsonl"
    if not train.exists():
        train.write_text("".join(json.dumps({"text": s}) + "\n" for s in repeated(300, seed=2)))
    return [
        "model.name=llama_debug",
        f"data.train={train}",
        *TINY_TRAINING,
        "trainer.max_num_steps=2",
        "trainer.checkpoint_every_n_steps=2",
        *extra,
    ]


def train_in_this_process(
    monkeypatch: pytest.MonkeyPatch, out: Path, config: list[str]
) -> nn.Module:
    """``python -m recipes.lm OUT --config CONFIG`` in this process; returns the model it built."""
    built: list[nn.Module] = []

    def spy(*args: Any, **kwargs: Any) -> nn.Module:
        built.append(parallelize_model(*args, **kwargs))
        return built[-1]

    parallelize_model = recipes.lm.model.parallelize_model
    with monkeypatch.context() as patch:
        patch.setattr(recipes.lm.model, "parallelize_model", spy)
        with pytest.raises(SystemExit) as exit_info:
            main(recipes.lm.recipe, LMConfig, [str(out), "--config", *config])
    assert exit_info.value.code == 0
    # The recipe's main destroyed the process group the FSDP2 run made.
    assert not dist.is_initialized()
    (model,) = built
    return model


def test_fsdp_on_one_process_shards_and_trains_as_the_unsharded_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from torch.distributed.tensor import DTensor

    monkeypatch.setenv("WORLD_SIZE", "1")
    plain = train_in_this_process(monkeypatch, tmp_path / "plain", lm_config(tmp_path))
    assert not any(isinstance(p, DTensor) for p in plain.parameters())

    fsdp = tmp_path / "fsdp"
    model = train_in_this_process(monkeypatch, fsdp, lm_config(tmp_path, "data_parallel=fsdp"))
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.device_mesh.size() == 1, name
    # float32 FSDP2 over one rank computes what the unsharded model computes, bit for bit, and
    # its checkpoint holds the same weights.
    assert losses(fsdp) == losses(tmp_path / "plain")
    expected, actual = last_model(tmp_path / "plain"), last_model(fsdp)
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[key], actual[key]) for key in expected)

    bf16 = tmp_path / "bf16"
    no_checkpoint = "trainer.checkpoint_every_n_steps=1000"
    model = train_in_this_process(monkeypatch, bf16, lm_config(tmp_path, *BF16_FSDP, no_checkpoint))
    assert fsdp_param_dtype(model) == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert losses(bf16) == pytest.approx(losses(tmp_path / "plain"), rel=BF16_RTOL)
    assert losses(bf16) != losses(tmp_path / "plain")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_checkpoint_of_fsdp_on_one_process_resumes_on_two(tmp_path: Path) -> None:
    """The char LM (whose reader reshards mid epoch) with FSDP2 in float32: the checkpoint of
    step 4 of a run on one process, resumed on two with half the batch each, trains the steps
    after it as the run of one process did."""
    from tests.conftest import run_python

    config = [
        "data.max_train_bytes=100000",
        "data.max_valid_bytes=10000",
        "data.seq_len=32",
        "model.dim=32",
        "model.num_heads=4",
        "model.ffn_dim=64",
        "model.num_layers=1",
        "model.dropout=0.0",
        "data_parallel=fsdp",
        "trainer.publish_metrics_every_n_steps=1",
        "trainer.validate_every_n_steps=100",
        "trainer.checkpoint_every_n_steps=4",
        "trainer.keep_last_n_checkpoints=null",
        "trainer.keep_best_n_checkpoints=null",
        "optimizer.warmup_steps=2",
    ]
    char_lm = ["-m", "recipes.char_lm"]
    whole = tmp_path / "whole"
    assert_ok(
        run_python(
            *char_lm, str(whole), "--config", *config, "data.batch_size=8",
            "trainer.max_num_steps=8", timeout=300,
        )
    )  # fmt: skip
    # The one-process run's checkpoint of step 4 (taken under the same schedule), resumed on
    # two processes with the same global batch.
    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "checkpoints" / "step_4", resumed / "checkpoints" / "step_4")
    assert_ok(
        torchrun(
            2, *char_lm, str(resumed), "--config", *config, "data.batch_size=4",
            "trainer.max_num_steps=8", "trainer.reshard_on_resume=true", timeout=600,
        )
    )  # fmt: skip
    log = (resumed / "logs" / "rank_0.log").read_text()
    assert "Resharding the checkpoint of step 4" in log
    records = read_jsonl(resumed / "metrics" / "train.jsonl")
    after = {r["step_nr"]: r["loss"] for r in records if "loss" in r and r["step_nr"] > 4}
    expected = {r["step_nr"]: r["loss"] for r in read_jsonl(whole / "metrics" / "train.jsonl")}
    assert sorted(after) == [5, 6, 7, 8]
    # The gradients are summed over two ranks in another order: close, not equal.
    assert [after[s] for s in range(5, 9)] == pytest.approx(
        [expected[s] for s in range(5, 9)], rel=1e-4
    )
    manifest = json.loads((resumed / "checkpoints" / "step_8" / "manifest.json").read_text())
    assert (manifest["world_size"], manifest["dp_shard_size"]) == (2, 2)


def test_a_run_refused_after_its_group_was_made_destroys_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The data is checked after the model is sharded: the refusal (one line, exit status 2)
    still destroys the one-process group."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    config = lm_config(tmp_path, "data_parallel=fsdp", f"data.train={tmp_path / 'none*.jsonl'}")
    with pytest.raises(SystemExit) as exit_info:
        main(recipes.lm.recipe, LMConfig, [str(tmp_path / "run"), "--config", *config])
    assert exit_info.value.code == 2
    assert "none*.jsonl matches no data file" in capsys.readouterr().err
    assert "Model: FSDPLlama" in (tmp_path / "run" / "logs" / "rank_0.log").read_text()
    assert not dist.is_initialized()
