"""Bad configuration of the char-LM recipe: each exits 2 with one ``error:`` line, nothing left.

Most cases call ``runtime.main`` in this process (the same code path as the command line, and
a fraction of the cost of a process each); the last ones run real processes to show what the
user's terminal gets. Every case also gets small data and step counts, so a case the runtime
failed to reject would train briefly and then fail the test, not run for minutes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from recipes.char_lm import CharLMConfig, recipe
from runtime import main
from tests.conftest import REPO_ROOT, torchrun
from tests.faults.conftest import Tally

pytestmark = pytest.mark.faults

SMALL = [
    # Our own sources: reading them is quicker than scanning the standard library every case.
    f"data.data_dir={REPO_ROOT / 'src'}",
    "data.valid_every_nth_file=3",
    "trainer.max_num_steps=2",
    "data.max_train_bytes=20000",
    "data.max_valid_bytes=4000",
    "data.seq_len=16",
    "data.batch_size=2",
]

# case: (extra command-line arguments, a piece of the expected error line)
OVERRIDE_CASES: dict[str, tuple[list[str], str]] = {
    "unknown_top_key": (["--config", "modle.dim=64"], "Unknown config key 'modle'"),
    "unknown_nested_key": (
        ["--config", "trainer.max_num_step=3"],
        "Did you mean 'trainer.max_num_steps'?",
    ),
    "int_as_word": (["--config", "trainer.max_num_steps=many"], "expects int, but got 'many'"),
    "int_as_float": (["--config", "model.dim=64.5"], "expects int, but got 64.5"),
    "bool_as_word": (["--config", "trainer.amp=maybe"], "expects bool or null, but got 'maybe'"),
    "float_as_word": (["--config", "optimizer.lr=fast"], "expects float, but got 'fast'"),
    "bad_literal": (["--config", "data_parallel=zero"], "expects one of 'auto', 'ddp', 'fsdp'"),
    "short_tuple": (["--config", "optimizer.betas=[0.9]"], "(2 items), but got [0.9]"),
    "section_as_scalar": (["--config", "model=3"], "expects a mapping of ModelSection keys"),
    "override_without_value": (["--config", "trainer.max_num_steps"], "must have the form"),
    "zero_steps": (["--config", "trainer.max_num_steps=0"], "max_num_steps must be greater"),
    "negative_steps": (["--config", "trainer.max_num_steps=-3"], "but is -3 instead"),
    "zero_batch_size": (["--config", "data.batch_size=0"], "batch_size must be greater"),
    "zero_accumulate": (["--config", "data.num_accumulate=0"], "num_accumulate must be greater"),
    "zero_seq_len": (["--config", "data.seq_len=0"], "data.seq_len must be greater"),
    "negative_warmup": (
        ["--config", "optimizer.warmup_steps=-5"],
        "optimizer.warmup_steps must be zero or more",
    ),
    "zero_checkpoint_cadence": (
        ["--config", "trainer.checkpoint_every_n_steps=0"],
        "checkpoint_every_n_steps must be greater",
    ),
    "negative_publish_cadence": (
        ["--config", "trainer.publish_metrics_every_n_steps=-1"],
        "publish_metrics_every_n_steps must be greater",
    ),
    "zero_keep_last": (
        ["--config", "trainer.keep_last_n_checkpoints=0"],
        "keep_last_n_checkpoints must be greater",
    ),
    "snapshots_off_the_checkpoint_schedule": (
        ["--config", "trainer.keep_checkpoint_every_n_steps=150"],
        "keep_checkpoint_every_n_steps (150) keeps the checkpoints of its multiples",
    ),
    "unscored_checkpoints": (
        ["--config", "trainer.checkpoint_every_n_steps=50", "trainer.validate_every_n_steps=100"],
        "must be a multiple of",
    ),
    "heads_not_dividing_dim": (["--config", "model.dim=130"], "must be a multiple of model.num"),
    "zero_tp_size": (["--config", "gang.tp_size=0"], "gang.tp_size must be greater than zero"),
    "tp_size_not_dividing_world": (
        ["--config", "gang.tp_size=2"],
        "gang.tp_size is 2, but must divide the number of processes (1). Use one of 1.",
    ),
    "zero_valid_every_nth_file": (
        ["--config", "data.valid_every_nth_file=0"],
        "valid_every_nth_file must be greater",
    ),
    "missing_data_dir": (["--config", "data.data_dir=/no/such/dir"], "/no/such/dir"),
    "missing_config_file": (["--config-file", "/no/such/config.yaml"], "does not exist"),
}


def call_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, str]:
    """main()'s exit status and stderr; an exception instead of an exit counts as a crash."""
    try:
        main(recipe, CharLMConfig, args)
    except SystemExit as ex:
        return ex.code, capsys.readouterr().err
    except Exception as ex:
        return f"crash: {type(ex).__name__}: {ex}", capsys.readouterr().err
    raise AssertionError("main() returned instead of exiting")


def assert_nothing_left(out: Path) -> None:
    """No output directory, or one holding just the log of the error."""
    if out.exists():
        assert sorted(p.name for p in out.iterdir()) in ([], ["logs"]), list(out.rglob("*"))


def judge(tally: Tally, out: Path, code: object, err: str, expected: str) -> None:
    # Start-up progress may be logged before the error; the error itself is one line.
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    ok = code == 2 and len(errors) == 1 and expected in errors[0] and "Traceback" not in err
    leftovers = sorted(p.name for p in out.iterdir()) if out.exists() else []
    ok = ok and leftovers in ([], ["logs"])
    tally.add(survived=ok, detail=f"{out.name}: exit {code}, left {leftovers}, stderr: {err!r}")


def test_bad_overrides_exit_2_with_one_line_and_leave_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tally: Tally
) -> None:
    for name, (args, expected) in OVERRIDE_CASES.items():
        out = tmp_path / name
        code, err = call_main([str(out), "--config", *SMALL, *args], capsys)
        judge(tally, out, code, err, expected)
    tally.check()


def test_bad_config_files_and_output_dirs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tally: Tally
) -> None:
    not_yaml = tmp_path / "not_yaml.yaml"
    not_yaml.write_text("trainer: [unclosed\n")
    a_list = tmp_path / "a_list.yaml"
    a_list.write_text("- trainer\n- model\n")
    data_file = tmp_path / "data.txt"
    data_file.write_text("not a directory\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    # case: (--config-file arguments, overrides after SMALL's, a piece of the error line)
    cases: list[tuple[str, list[str], list[str], str]] = [
        ("file_not_yaml", ["--config-file", str(not_yaml)], [], "is not valid YAML"),
        ("file_not_mapping", ["--config-file", str(a_list)], [], "must hold a mapping"),
        ("data_dir_is_a_file", [], [f"data.data_dir={data_file}"], "must be a directory"),
    ]
    for name, files, overrides, expected in cases:
        out = tmp_path / name
        code, err = call_main([str(out), *files, "--config", *SMALL, *overrides], capsys)
        judge(tally, out, code, err, expected)
    # An output directory that cannot be made: its parent is a file; or a read-only filesystem.
    for out in (a_file / "run", Path("/proc/trainkit_run")):
        code, err = call_main([str(out), "--config", *SMALL], capsys)
        judge(tally, out, code, err, "cannot be created")
    tally.check()


def rank_stderr_lines(log_dir: Path) -> list[list[str]]:
    """Each rank's stderr lines, from torchrun's ``--log-dir`` with ``--redirects 2``."""
    files = sorted(log_dir.glob("*/attempt_0/*/stderr.log"), key=lambda f: int(f.parent.name))
    return [f.read_text().splitlines() for f in files]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        (
            "gang.ep_size=4",
            "error: gang.ep_size is 4, but must divide the DP size (2 = 2 processes / "
            "gang.tp_size 1). Use one of 1, 2.",
        ),
        # The other refusals of this path (make test-all): a dense model's, and an SP size.
        pytest.param(
            "gang.ep_size=2",
            "error: gang.ep_size is 2, but LlamaForCausalLM has no stacked experts to split. "
            "Use gang.ep_size=1 for a dense model.",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "gang.sp_size=4",
            "error: gang.sp_size is 4, but must divide the processes over TP (2 = 2 processes / "
            "gang.tp_size 1). Use one of 1, 2.",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_gang_size_refused_under_torchrun_reads_the_same_on_every_rank(
    tmp_path: Path, sizes: str, expected: str
) -> None:
    """An EP size that does not divide the DP size (refused as the gangs are made) and one for
    a dense model (refused as the model is built): every rank prints the same single line,
    naming the key, and exits 2, with nothing left but the logs."""
    from tests.recipes.families import FAMILY_BY_NAME, make_family_dir, write_train

    model_dir, train = make_family_dir(FAMILY_BY_NAME["Llama"], tmp_path / "model"), tmp_path / "t"
    write_train(train)
    out, logs = tmp_path / "run", tmp_path / "torchrun_logs"
    args = [f"model.hf_path={model_dir}", f"data.train={train}", "data.num_workers=0", sizes]
    result = torchrun(
        2, "--log-dir", str(logs), "--redirects", "2", "-m", "recipes.lm", str(out),
        "--config", *args, timeout=300,
    )  # fmt: skip
    per_rank = rank_stderr_lines(logs)
    assert len(per_rank) == 2, result.stderr[-3000:]
    for lines in per_rank:
        assert [line for line in lines if line.startswith("error: ")] == [expected], lines
        assert not any("Traceback" in line for line in lines), lines
    assert "exitcode  : 2" in result.stderr, result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["logs"]
