"""Starting from weights (``init_from``): an export file or a checkpoint directory, any layout;
key mismatches are clear; a resumed run ignores it. The runs are tests/workers/resume_toy.py:
under torchrun for the sharded layouts, in this process for one (``runtime.main``, the path of
the command line, without a process's start-up); exports go through ``python -m runtime``'s
``main``, in this process too."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from gangs import Gangs
from runtime import InitialWeightsError, load_initial_weights
from runtime.cli import tools
from tests.conftest import assert_ok, torchrun
from tests.faults.jobs import run_single

WORKER = "tests/workers/resume_toy.py"


def params(file: Path) -> dict[str, Tensor]:
    loaded: dict[str, Tensor] = torch.load(file, weights_only=True)
    return loaded


def assert_identical(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert actual.keys() == expected.keys()
    assert not [k for k in expected if not torch.equal(actual[k], expected[k])]


@pytest.fixture(scope="module")
def source_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished single-process run of 10 steps, with checkpoints at steps 2, 4, ..., 10."""
    out = tmp_path_factory.mktemp("source")
    assert_ok(run_single(out))
    return out


def export(source: Path, destination: Path, *flags: str) -> None:
    assert tools.main(["export", str(source), str(destination), *flags]) == 0


@pytest.mark.distributed
def test_init_from_an_export_under_fsdp2(source_run: Path, tmp_path: Path) -> None:
    exported = tmp_path / "weights.pt"
    export(source_run, exported, "--step", "4")
    out = tmp_path / "run"
    result = torchrun(
        2,
        WORKER,
        str(out),
        "--config",
        "batch_size=4",
        "kind=fsdp",
        f"init_from={exported}",
        "save_initial_params=true",
        "max_num_steps=1",
    )
    assert_ok(result)
    assert_identical(params(out / "initial_params.pt"), params(exported))
    assert f"Initialized 6 model tensors from {exported}" in (out / "logs/rank_0.log").read_text()


@pytest.mark.distributed
@pytest.mark.parametrize("which", [pytest.param("run_dir", marks=pytest.mark.slow), "step_dir"])
def test_init_from_a_checkpoint_directory(source_run: Path, tmp_path: Path, which: str) -> None:
    init_from = source_run if which == "run_dir" else source_run / "checkpoints" / "step_4"
    expected = tmp_path / "expected.pt"
    export(source_run, expected, "--step", "10" if which == "run_dir" else "4")
    out = tmp_path / "run"
    result = torchrun(
        2,
        WORKER,
        str(out),
        "--config",
        "batch_size=4",
        f"init_from={init_from}",
        "save_initial_params=true",
        "max_num_steps=1",
    )
    assert_ok(result)
    assert_identical(params(out / "initial_params.pt"), params(expected))


def test_a_key_mismatch_exits_2_naming_the_keys(source_run: Path, tmp_path: Path) -> None:
    weights = params(source_run / "params.pt")
    weights["upper.weight"] = weights.pop("up.weight")
    torch.save(weights, tmp_path / "renamed.pt")
    result = run_single(tmp_path / "run", f"init_from={tmp_path / 'renamed.pt'}")
    assert result.returncode == 2, result.stderr
    (error_line,) = [line for line in result.stderr.splitlines() if "error:" in line]
    assert "1 missing key (up.weight)" in error_line
    assert "1 unexpected key (upper.weight)" in error_line
    assert "Traceback" not in result.stderr


def test_a_resumed_run_ignores_init_from(source_run: Path, tmp_path: Path) -> None:
    shutil.copytree(source_run / "checkpoints" / "step_4", tmp_path / "checkpoints" / "step_4")
    # It would fail if it were read: the file does not exist.
    result = run_single(tmp_path, f"init_from={tmp_path / 'no_such_file.pt'}")
    assert_ok(result)
    log_text = (tmp_path / "logs" / "rank_0.log").read_text()
    assert "Resumed from the checkpoint of step 4." in log_text
    assert "Initialized" not in log_text
    assert_identical(params(tmp_path / "params.pt"), params(source_run / "params.pt"))


# ------------------------------------------------------------------- in one process


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)


def test_rename_and_skip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = Pair()
    weights = {k.replace("encoder.", "backbone."): v for k, v in source.state_dict().items()}
    weights["extra.bias"] = torch.zeros(1)
    torch.save(weights, tmp_path / "w.pt")

    model = Pair()
    head_before = model.head.weight.detach().clone()
    with pytest.raises(InitialWeightsError) as error:
        load_initial_weights(model, tmp_path / "w.pt", gangs=Gangs.single())
    message = str(error.value)
    assert "2 missing keys (encoder.weight, encoder.bias)" in message
    assert "3 unexpected keys (backbone.weight, backbone.bias, extra.bias)" in message
    assert "rename=" in message and "skip=" in message

    weights["head.weight"] = torch.full((2, 4), 7.0)
    torch.save(weights, tmp_path / "w.pt")
    loaded = load_initial_weights(
        model,
        tmp_path / "w.pt",
        gangs=Gangs.single(),
        rename={"backbone.": "encoder."},
        skip=["extra.*", "head.weight"],
    )
    assert set(loaded.loaded_keys) == {"encoder.weight", "encoder.bias", "head.bias"}
    assert loaded.skipped_keys == ("head.weight",)
    assert torch.equal(model.encoder.weight, source.encoder.weight)
    assert torch.equal(model.head.weight, head_before)  # skipped: keeps its initialization


def test_a_shape_mismatch_names_the_key(tmp_path: Path) -> None:
    weights = Pair().state_dict()
    weights["head.weight"] = torch.zeros(3, 4)
    torch.save(weights, tmp_path / "w.pt")
    with pytest.raises(InitialWeightsError, match=r"'head.weight' .* \(3, 4\), but the model's"):
        load_initial_weights(Pair(), tmp_path / "w.pt", gangs=Gangs.single())


def test_a_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InitialWeightsError, match="does not exist"):
        load_initial_weights(Pair(), tmp_path / "nothing.pt", gangs=Gangs.single())
    with pytest.raises(InitialWeightsError, match="holds no checkpoint"):
        load_initial_weights(Pair(), tmp_path, gangs=Gangs.single())


@pytest.mark.skipif(
    importlib.util.find_spec("safetensors") is None, reason="safetensors is not installed"
)
def test_export_writes_safetensors_when_installed(source_run: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    export(source_run, tmp_path / "model.pt")
    expected = params(tmp_path / "model.pt")
    assert_identical(load_file(tmp_path / "model.safetensors"), expected)
    model = nn.Module()
    # The toy model's layout: norm, up, down.
    model.norm, model.up, model.down = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 4)
    load_initial_weights(model, tmp_path / "model.safetensors", gangs=Gangs.single())
    assert_identical(dict(model.state_dict()), expected)
