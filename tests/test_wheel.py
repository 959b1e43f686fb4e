"""The wheel is the product: built from the repository, installed on its own, and used as a user
uses it, from an empty directory with nothing of the checkout on the path. Its recipe trains on
two ranks and exports a model that ``transformers`` loads, and a recipe of the user's own
(docs/examples/dpo_recipe.py) composes the installed parts into a DPO run under FSDP2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT, assert_ok, child_env, read_jsonl, torchrun
from tests.recipes.test_lm import (
    TINY_TRAINING,
    last_model,
    make_hf_llama_dir,
    repeated,
    write_jsonl,
)
from tests.recipes.test_preference import write_pairs
from units.preference import PAIR_METRICS

transformers = pytest.importorskip("transformers")

PACKAGES = ("trainkit_utils", "gangs", "units", "checkpoint", "models", "runtime", "recipes")
"""The top-level packages the wheel installs, as pyproject.toml lists them."""

DPO_RECIPE = REPO_ROOT / "docs" / "examples" / "dpo_recipe.py"

# What the wheel is built from. pip builds in the source tree it is given, and setuptools ships
# whatever that tree's build/lib still holds (modules deleted since included): the build runs
# on a copy, so the checkout is left as it was and a stale build/ there cannot reach the wheel.
BUILD_INPUTS = ("pyproject.toml", "README.md", "src", "recipes")


@dataclass(frozen=True)
class InstalledWheel:
    wheel: Path
    target: Path
    """The directory ``pip install --target`` installed the wheel into."""

    def env(self) -> dict[str, str]:
        """A child's environment with the installed wheel alone on PYTHONPATH: ``child_env``'s
        extra values replace the checkout's paths it would otherwise put there."""
        return child_env({"PYTHONPATH": str(self.target)})

    def python(
        self, *args: str, cwd: Path, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """``python ARGS`` (this venv's) on the installed wheel; asserts nothing."""
        return subprocess.run(
            [sys.executable, *args],
            env=self.env(),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def pip(*args: str) -> None:
    assert_ok(
        subprocess.run(
            # No index: the build and the install take nothing from the network.
            [sys.executable, "-m", "pip", *args, "--no-index", "--disable-pip-version-check"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    )


@pytest.fixture(scope="session")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> InstalledWheel:
    """The wheel built once per session, and installed without its dependencies (the venv has
    them) into a directory of its own."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in BUILD_INPUTS:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=ignore)
        else:
            shutil.copy2(path, source / name)
    pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist"), str(source))
    (wheel,) = (root / "dist").glob("trainkit-*.whl")
    pip("install", "--no-deps", "-q", "--target", str(root / "site"), str(wheel))
    return InstalledWheel(wheel, root / "site")


@pytest.fixture(scope="module")
def hf_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_llama_dir(tmp_path_factory.mktemp("hf_llama"))


@pytest.fixture
def empty_dir(tmp_path: Path) -> Path:
    """The working directory of the children: nothing in it for Python to import."""
    path = tmp_path / "cwd"
    path.mkdir()
    return path


def test_the_wheel_holds_the_packages_and_the_recipes_and_no_tests(
    installed_wheel: InstalledWheel,
) -> None:
    names = zipfile.ZipFile(installed_wheel.wheel).namelist()
    assert "recipes/lm/__main__.py" in names
    assert "recipes/char_lm/__main__.py" in names
    assert {"recipes/lm/configs/sft.yaml", "recipes/lm/configs/dpo.yaml"} <= set(names)
    assert not [name for name in names if name.startswith("tests/")]
    top_level = {
        name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")
    }
    assert top_level == set(PACKAGES)


# Imports every module of the installed packages and reports, as JSON, those that fail and those
# loaded from anywhere but TARGET. A module missing from the wheel shows in one or the other: it
# fails to import, or an editable install of the repository (a setuptools finder that comes
# after PYTHONPATH) supplies the checkout's copy.
IMPORT_EVERYTHING = """
import importlib, json, pkgutil, sys
target, packages = sys.argv[1], sys.argv[2:]
failed = {}
for package in packages:
    path = importlib.import_module(package).__path__
    for info in pkgutil.walk_packages(path, package + "."):
        if not info.name.endswith(".__main__"):  # a command: the runs below start them
            try:
                importlib.import_module(info.name)
            except Exception as ex:
                failed[info.name] = repr(ex)
files = {
    name: getattr(module, "__file__", None) or ""
    for name, module in sys.modules.items()
    if name.split(".")[0] in packages
}
outside = {name: file for name, file in files.items() if not file.startswith(target)}
print(json.dumps({"files": files, "failed": failed, "outside": outside}))
"""


def test_every_module_imports_from_the_installed_wheel_alone(
    installed_wheel: InstalledWheel, empty_dir: Path
) -> None:
    target = str(installed_wheel.target) + "/"
    result = installed_wheel.python("-c", IMPORT_EVERYTHING, target, *PACKAGES, cwd=empty_dir)
    assert_ok(result)
    report = json.loads(result.stdout)
    assert report["files"]["recipes"].startswith(target)
    assert report["files"]["runtime"].startswith(target)
    assert "recipes.lm.units" in report["files"]
    assert report["failed"] == {}
    assert report["outside"] == {}


def assert_the_export_loads_with_the_trained_weights(
    installed_wheel: InstalledWheel, out: Path, model_dir: Path, cwd: Path
) -> None:
    """``python -m runtime export OUT DEST --format hf`` of the installed wheel writes a directory
    that ``from_pretrained`` loads with the weights of OUT's last checkpoint: the model's keys
    (no reference model's beside them), trained away from those of ``model_dir``."""
    destination = out.parent / "exported"
    export = ("-m", "runtime", "export", str(out), str(destination), "--format", "hf")
    assert_ok(installed_wheel.python(*export, cwd=cwd))
    exported = transformers.AutoModelForCausalLM.from_pretrained(destination).state_dict()
    trained = last_model(out)
    assert trained.keys() == exported.keys()
    for key, value in trained.items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=0)
    original = transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert any(not torch.equal(value, exported[key]) for key, value in original.items())


@pytest.mark.distributed
def test_the_installed_lm_recipe_trains_on_two_ranks_and_exports_a_model_transformers_loads(
    installed_wheel: InstalledWheel, hf_llama_dir: Path, empty_dir: Path, tmp_path: Path
) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": s} for s in repeated(100, seed=2)])
    out = tmp_path / "run"
    config = (
        *TINY_TRAINING,
        f"model.hf_path={hf_llama_dir}",
        f"data.train={train}",
        "trainer.max_num_steps=2",
        "trainer.checkpoint_every_n_steps=2",
    )
    command = ("-m", "recipes.lm", str(out), "--config", *config)
    assert_ok(torchrun(2, *command, env=installed_wheel.env(), cwd=empty_dir))
    assert [r["step_nr"] for r in read_jsonl(out / "metrics" / "train.jsonl")] == [1, 2]

    assert_the_export_loads_with_the_trained_weights(installed_wheel, out, hf_llama_dir, empty_dir)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_users_dpo_recipe_trains_under_fsdp2_on_two_ranks_from_the_installed_parts(
    installed_wheel: InstalledWheel, hf_llama_dir: Path, empty_dir: Path, tmp_path: Path
) -> None:
    # The user's file, in a directory of its own beside the empty working directory.
    script = tmp_path / "user" / "dpo_recipe.py"
    script.parent.mkdir()
    shutil.copy2(DPO_RECIPE, script)
    pairs = write_pairs(tmp_path / "pairs.jsonl", 24, seed=1)
    out = tmp_path / "run"
    config = (
        f"model_dir={hf_llama_dir}",
        f"pairs={pairs}",
        "max_len=32",
        "batch_size=2",
        "lr=0.01",
        "max_num_steps=3",
        "checkpoint_every_n_steps=3",
        "publish_every_n_steps=1",
    )
    command = (str(script), str(out), "--config", *config)
    assert_ok(torchrun(2, *command, env=installed_wheel.env(), cwd=empty_dir))

    records = read_jsonl(out / "metrics" / "train.jsonl")
    assert [r["step_nr"] for r in records] == [1, 2, 3]
    assert all(set(PAIR_METRICS) <= r.keys() for r in records)
    # The reference holds the policy's initial weights: the first step's rewards are zero.
    assert records[0]["rewards/margins"] == 0.0
    assert records[0]["loss"] == pytest.approx(0.6931472, abs=1e-6)  # log 2
    assert records[-1]["rewards/margins"] != 0.0

    # FSDP2 sharded the policy over both ranks, and the export holds the policy alone.
    manifest = json.loads((out / "checkpoints" / "step_3" / "manifest.json").read_text())
    assert manifest["dp_shard_size"] == 2
    assert_the_export_loads_with_the_trained_weights(installed_wheel, out, hf_llama_dir, empty_dir)
