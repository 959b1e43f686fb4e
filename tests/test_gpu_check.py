"""scripts/gpu_check.sh, the first run on a GPU machine: its dry run checks every part here, and
its parts run under their own time limits into one report."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO_ROOT, child_env


def load_gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", REPO_ROOT / "scripts/gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_check = load_gpu_check()


def test_the_dry_run_checks_every_part(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(REPO_ROOT / "scripts/gpu_check.sh"), str(tmp_path), "--dry-run"],
        env=child_env({"PYTHON": sys.executable, "WHEELS_DIR": str(tmp_path / "no-wheels")}),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = (tmp_path / "report.md").read_text()
    for part in gpu_check.make_parts(tmp_path):
        assert f"| {part.name} | {part.what} | checked |" in report
    assert (tmp_path / "data" / "train.txt").stat().st_size > 0
    # It shows each part's command: the 1B runs are FSDP2 in bf16 on one GPU, with and
    # without activation checkpointing.
    fsdp_bf16 = "data_parallel=fsdp fsdp.param_dtype=bfloat16 fsdp.reduce_dtype=float32"
    for checkpointing in ("false", "true"):
        shown = f"{fsdp_bf16} trainer.amp=false model.activation_checkpointing={checkpointing}"
        assert shown in result.stdout


LM_1B_ON_A_CPU = {
    "model.name=llama_1b": "model.name=llama_debug",
    "data.seq_len=2048": "data.seq_len=64",
    "trainer.max_num_steps=30": "trainer.max_num_steps=4",
    "trainer.max_num_steps=20": "trainer.max_num_steps=4",
    "trainer.publish_metrics_every_n_steps=10": "trainer.publish_metrics_every_n_steps=2",
    "optimizer.warmup_steps=5": "optimizer.warmup_steps=1",
}


@pytest.mark.slow
@pytest.mark.parametrize("part_name", ["lm_1b", "lm_1b_ac", "lm_pp2"])
def test_the_1b_parts_command_trains_a_small_llama_on_a_cpu(tmp_path: Path, part_name: str) -> None:
    """The part's own command line, llama_debug for llama_1b: the recipe takes every argument,
    shards with FSDP2 on one process (or splits into two pipeline stages on two) and learns,
    and the part's figure reads its metrics."""
    (part,) = [p for p in gpu_check.make_parts(tmp_path) if p.name == part_name]
    command = [LM_1B_ON_A_CPU.get(arg, arg) for arg in part.command]
    gpu_check.write_lm_data(tmp_path / "data" / "train.txt", num_bytes=100_000)
    log = tmp_path / f"{part_name}.log"
    with log.open("w") as sink:
        returncode = subprocess.call(
            command, stdout=sink, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO_ROOT,
            timeout=300,
        )  # fmt: skip
    outcome = gpu_check.Outcome(returncode, log, tmp_path / part_name, 0.0)
    passed, figure = gpu_check.training_figure(outcome)
    assert passed, (figure, log.read_text()[-3000:])
    assert "loss" in figure and "tokens/s" in figure


def test_the_dry_run_names_what_would_stop_a_part(tmp_path: Path) -> None:
    part = gpu_check.Part(
        "broken",
        "a recipe with a key it does not have",
        [sys.executable, "-m", "recipes.no_such_recipe"],
        10,
        gpu_check.training_figure,
        [("recipes.char_lm", "CharLMConfig", ["trainer.max_num_stepz=3"])],
    )
    problems = gpu_check.check_part(part)
    assert problems[0] == "no module recipes.no_such_recipe"
    assert "max_num_stepz" in problems[1]


def python_part(name: str, code: str, timeout_s: int) -> object:
    return gpu_check.Part(
        name, name, [sys.executable, "-c", code], timeout_s, gpu_check.bench_figure(("x",))
    )


@pytest.mark.skipif(sys.platform != "linux", reason="needs coreutils' timeout")
def test_each_part_has_its_time_limit_and_the_report_its_figure(tmp_path: Path) -> None:
    fast = python_part("fast", "print('BENCH_RESULT {\"x\": 2.5}')", 30)
    hung = python_part("hung", "import time; time.sleep(60)", 1)
    rows = gpu_check.run_parts([fast, hung], tmp_path, budget_s=60)
    late = gpu_check.run_parts([fast], tmp_path, budget_s=5)  # no time left for it
    assert [row.status for row in rows + late] == [
        "passed",
        "timed out (1 s)",
        "not run: the budget is spent; rerun with --parts fast",
    ]
    assert rows[0].figure == "x 2.5"
    report = gpu_check.write_report(tmp_path, rows, ["- Device: none"], "GPU check").read_text()
    assert "| fast | fast | passed | x 2.5 |" in report and "logs/hung.log |" in report
    assert "import time" in (tmp_path / "logs" / "hung.log").read_text()


def test_the_report_compares_the_trainer_with_the_hand_written_loop(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    for loop, tokens_per_s in (("hand", 1000.0), ("trainer", 990.0)):
        log = tmp_path / "logs" / f"bench_1b_{loop}.log"
        log.write_text(f'warming up\nBENCH_RESULT {{"tokens_per_s": {tokens_per_s}}}\n')
    (line,) = gpu_check.trainer_against_hand(tmp_path)
    assert "tokens per second = 0.990 (goal: >= 0.98)" in line


def test_a_part_needing_two_gpus_is_skipped_in_one_line_on_fewer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (part,) = [p for p in gpu_check.make_parts(tmp_path) if p.name == "lm_pp2"]
    assert part.min_gpus == 2 and "gang.pp_size=2" in part.command
    found = gpu_check.gpu_count()
    if found >= 2:
        pytest.skip(f"{found} GPUs here: the part would run")
    (row,) = gpu_check.run_parts([part], tmp_path, budget_s=60)
    assert row.status == f"skipped: needs 2 GPUs, this machine has {found}"
    assert capsys.readouterr().out == f"gpu_check: lm_pp2: {row.status}.\n"
    assert not (tmp_path / "lm_pp2").exists()


def test_a_part_that_needs_more_gpus_than_here_is_skipped_in_one_line(tmp_path: Path) -> None:
    (sp2,) = [p for p in gpu_check.make_parts(tmp_path) if p.name == "lm_sp2"]
    assert sp2.min_gpus == 2
    assert "--nproc-per-node=2" in sp2.command and "gang.sp_size=2" in sp2.command
    here = gpu_check.gpu_count()
    more = python_part("more", "raise SystemExit(3)", 30)
    more = gpu_check.Part(**{**more.__dict__, "min_gpus": max(2, here + 1)})
    (row,) = gpu_check.run_parts([more], tmp_path, budget_s=60)
    assert row.status == f"skipped: needs {max(2, here + 1)} GPUs, this machine has {here}"
    assert gpu_check.skipped(row) and not (tmp_path / "logs" / "more.log").exists()
