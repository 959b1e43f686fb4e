"""The recipe command line on ``tests/runtime/cli/cli_recipe.py``: most cases call ``runtime.main``
in this process (the code path of the command line, without a process's start-up each); the
cases about what only a process shows (the traceback, stray output around an error, torchrun's
ranks) run real processes."""

from __future__ import annotations

import importlib
import io
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO_ROOT, RunTorch, assert_ok, child_env, main_in_process
from tests.runtime.cli.cli_recipe import CliRecipeConfig, recipe

RECIPE_MODULE = "tests.runtime.cli.cli_recipe"
RECIPE_SCRIPT = "tests/runtime/cli/cli_recipe.py"

Result = subprocess.CompletedProcess[str]


def run_modules(commands: dict[str, list[str]]) -> dict[str, Result]:
    """Run ``python -m MODULE ARGS`` for each entry, all at once.

    Each process spends most of its time importing torch, so running them side by side keeps
    the file fast.
    """
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", *argv],
            env=child_env(),
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, argv in commands.items()
    }
    results = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return results


ERROR_CASES: dict[str, tuple[list[str], str]] = {
    "unknown_key": (
        ["--config", "gang.tp_sise=2"],
        "error: Unknown config key 'gang.tp_sise'. Valid keys under 'gang': tp_size. "
        "Did you mean 'gang.tp_size'? (from --config gang.tp_sise=2)",
    ),
    "wrong_type": (
        ["--config", "max_num_steps=abc"],
        "error: Config key 'max_num_steps' expects int, but got 'abc' (str). "
        "(from --config max_num_steps=abc)",
    ),
    "bad_value": (
        ["--config", "gang.tp_size=0"],
        "error: The config is invalid: gang.tp_size must be at least 1, but is 0.",
    ),
    "recipe_value_error": (
        ["--config", "max_num_steps=-3"],
        "error: max_num_steps must be greater than zero, but is -3 instead.",
    ),
    "missing_config_file": (
        ["--config-file", "no/such/file.yaml"],
        "error: Config file 'no/such/file.yaml' does not exist. "
        "Check the path given to --config-file.",
    ),
    "bad_flag": (
        ["--confgi", "x=1"],
        "error: unrecognized arguments: --confgi x=1. Run with --help for usage.",
    ),
}


def run_cli_recipe(argv: list[str]) -> Result:
    return main_in_process(recipe, CliRecipeConfig, argv)


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Result]]:
    """The cases that need a real process, side by side: a recipe error (nothing but its line
    on the terminal) and an error inside ``run()`` (the interpreter's traceback)."""
    root = tmp_path_factory.mktemp("cli")
    args = ERROR_CASES["recipe_value_error"][0]
    return root, run_modules(
        {
            "recipe_value_error": [RECIPE_MODULE, str(root / "recipe_value_error"), *args],
            "fail_in_run": [
                RECIPE_MODULE,
                str(root / "fail_in_run"),
                "--config",
                "fail_in_run=true",
            ],
        }
    )


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_errors_print_one_line_and_exit_2(tmp_path: Path, case: str) -> None:
    args, expected = ERROR_CASES[case]
    result = run_cli_recipe([str(tmp_path / case), *args])

    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [expected]
    assert result.stdout == ""


def test_config_errors_create_no_output_dir(tmp_path: Path) -> None:
    for case in ("unknown_key", "wrong_type", "bad_value", "missing_config_file"):
        assert run_cli_recipe([str(tmp_path / case), *ERROR_CASES[case][0]]).returncode == 2
        assert not (tmp_path / case).exists(), case


def test_a_recipe_error_in_a_process_is_one_line_and_logged_to_the_rank_log(
    processes: tuple[Path, dict[str, Result]],
) -> None:
    root, results = processes
    result = results["recipe_value_error"]

    # Nothing else reaches the terminal: no warning, no traceback, no log line.
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [ERROR_CASES["recipe_value_error"][1]]
    assert result.stdout == ""
    log = (root / "recipe_value_error" / "logs" / "rank_0.log").read_text(encoding="utf-8")
    assert "max_num_steps must be greater than zero, but is -3 instead." in log


def test_missing_output_dir_is_a_one_line_usage_error() -> None:
    result = run_cli_recipe([])

    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: the following arguments are required: OUTPUT_DIR. Put OUTPUT_DIR first, since "
        "--config takes every value after it. Run with --help for usage."
    ]


def test_dump_config_prints_effective_yaml_and_creates_nothing(tmp_path: Path) -> None:
    argv = ["--config", "max_num_steps=9", "lr=1e-4", "--config", "betas=[0.8, 0.9]"]
    result = run_cli_recipe([str(tmp_path / "dump"), *argv, "--dump-config"])

    assert_ok(result)
    dumped = yaml.safe_load(result.stdout)
    assert dumped["max_num_steps"] == 9
    assert dumped["lr"] == 1e-4
    assert dumped["betas"] == [0.8, 0.9]
    assert dumped["gang"] == {"tp_size": 1}
    assert not (tmp_path / "dump").exists()


def test_dump_config_needs_no_output_dir() -> None:
    result = run_cli_recipe(["--dump-config", "--config", "lr=0.5"])

    assert_ok(result)
    assert yaml.safe_load(result.stdout)["lr"] == 0.5


def test_lm_dump_config_shows_every_key_before_the_required_ones_are_given() -> None:
    from recipes.lm import LMConfig
    from runtime.cli.config import config_keys, config_to_dict

    result = run_main("lm", ["--dump-config"])

    assert_ok(result)
    assert yaml.safe_load(result.stdout) == config_to_dict(LMConfig())
    lines = result.stdout.splitlines()
    assert "  name: null  # required, unless model.hf_path is given" in lines
    assert "  train: null  # required, unless data.mixture is given" in lines
    marked = [line.split(":")[0].strip() for line in lines if "# required" in line]
    assert marked == [key.name.split(".")[-1] for key in config_keys(LMConfig) if key.requirement]


def recipe_config(recipe: str) -> tuple[Any, type[Any]]:
    module = importlib.import_module(f"recipes.{recipe}")
    return module.recipe, getattr(module, {"lm": "LMConfig", "char_lm": "CharLMConfig"}[recipe])


def run_main(recipe: str, argv: list[str]) -> Result:
    """The recipe's ``main`` in this process: its exit status, stdout and stderr."""
    return main_in_process(*recipe_config(recipe), argv)


@pytest.mark.parametrize("recipe", ["lm", "char_lm"])
def test_recipe_help_lists_each_key_with_its_meaning(recipe: str) -> None:
    result = run_main(recipe, ["--help"])

    assert result.returncode == 0
    help_text = " ".join(result.stdout.split())
    assert "config keys (set with --config KEY=VALUE" in help_text
    assert "trainer.max_num_steps Optimizer steps to train for;" in help_text
    if recipe == "lm":
        assert "model.name [required, unless model.hf_path is given] The project's" in help_text
    else:
        assert "model.num_heads Attention heads per block;" in help_text


def test_a_missing_required_key_at_run_time_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = run_main("lm", [str(tmp_path / "run")])

    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: Give exactly one of model.hf_path or model.name, but neither is set. "
        "model.hf_path: A Hugging Face causal LM directory: built from its config.json, loaded "
        "from its weights. model.name: The project's Llama-style model: llama_debug, llama_125m, "
        "llama_1b or llama_8b."
    ]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("recipe", ["lm", "char_lm"])
def test_every_key_of_the_recipes_has_a_meaning(recipe: str) -> None:
    from runtime.cli.config import config_keys

    keys = config_keys(recipe_config(recipe)[1])

    assert [key.name for key in keys if not key.meaning and not key.is_section] == []


def test_run_writes_config_and_rank_log(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text("max_num_steps: 5\nparallelism: fsdp\n", encoding="utf-8")
    out = tmp_path / "run"
    argv = ["--config-file", str(tmp_path / "base.yaml"), "--config", "max_num_steps=7"]
    result = run_cli_recipe([str(out), *argv])
    assert_ok(result)

    written = yaml.safe_load((out / "config.yaml").read_text(encoding="utf-8"))
    log = (out / "logs" / "rank_0.log").read_text(encoding="utf-8")

    # Defaults < --config-file < --config.
    assert written["max_num_steps"] == 7
    assert written["parallelism"] == "fsdp"
    assert written["lr"] == 1e-3
    assert "[rank 0] INFO" in log
    assert "Effective config:" in log
    assert "Fake training for 7 steps" in log
    # The console gets the recipe's own logging but not the config dump.
    assert "Fake training for 7 steps" in result.stderr
    assert "Effective config:" not in result.stderr


def test_exit_status_comes_from_run(tmp_path: Path) -> None:
    result = run_cli_recipe([str(tmp_path / "run"), "--config", "exit_code=3"])
    assert result.returncode == 3


def test_error_inside_run_propagates_with_traceback(
    processes: tuple[Path, dict[str, Result]],
) -> None:
    root, results = processes
    result = results["fail_in_run"]

    assert result.returncode not in (0, 2)
    assert "Traceback" in result.stderr
    assert "RuntimeError: Fake failure inside run()." in result.stderr
    log = (root / "fail_in_run" / "logs" / "rank_0.log").read_text(encoding="utf-8")
    assert "RuntimeError: Fake failure inside run()." in log


@pytest.mark.distributed
def test_torchrun_logs_every_rank_and_writes_config_once(
    run_torchrun: RunTorch, tmp_path: Path
) -> None:
    out = tmp_path / "out"

    result = run_torchrun(2, RECIPE_SCRIPT, str(out), "--config", "max_num_steps=4", timeout=120)

    assert_ok(result)
    assert yaml.safe_load((out / "config.yaml").read_text(encoding="utf-8"))["max_num_steps"] == 4
    logs = {
        rank: (out / "logs" / f"rank_{rank}.log").read_text(encoding="utf-8") for rank in (0, 1)
    }
    for rank, log in logs.items():
        assert f"[rank {rank}] INFO" in log
        assert "All-reduced over 2 ranks." in log
    assert "Wrote the effective config" in logs[0]
    assert "Wrote the effective config" not in logs[1]
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["rank_0.log", "rank_1.log"]


def test_main_gives_the_root_logger_back_as_it_found_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler left on the root logger would write to a stream its caller has since closed."""
    from runtime import main

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    with pytest.raises(SystemExit) as exit_info:
        main(recipe, CliRecipeConfig, [str(tmp_path / "run"), "--config", "max_num_steps=0"])
    assert exit_info.value.code == 2
    assert root.handlers == handlers and root.level == level
    stderr.close()
    logging.getLogger("runtime").warning("logged after main() returned")
