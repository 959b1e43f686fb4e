"""``python -m runtime prepare`` and ``verify-data`` as a user runs them: workers, a kill -9 and
the rerun that finishes the job, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.cli.tools import main
from runtime.data.text import ByteTokenizer, PreparedDataset, prepare_dataset
from tests.conftest import child_env, in_process, run_python
from tests.runtime.data.test_prepared_writer import documents

pytestmark = pytest.mark.distributed  # processes of their own


def write_jsonl(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents(count, 3)))
    return path


# In make test, test_prepared_writer.py stops a preparation mid-way (a full disk) and goes on.
@pytest.mark.slow
def test_kill_9_mid_way_then_the_same_command_finishes_from_the_finished_chunks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", 12_000)  # 1.5 MB: some 750 chunks of 2 KiB
    out = tmp_path / "out"
    command = [sys.executable, "-m", "runtime", "prepare", str(out), "--tokenizer", "bytes"]
    command += [str(data), "--num-workers", "1", "--chunk-mb", str(2 / 1024)]
    chunks = out / ".prepare" / "chunks"
    with subprocess.Popen(command, env=child_env(), stderr=subprocess.PIPE, text=True) as job:
        deadline = time.monotonic() + 120
        while not (chunks.is_dir() and len(list(chunks.iterdir())) >= 20):
            assert job.poll() is None, job.stderr.read() if job.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.05)
        job.send_signal(signal.SIGKILL)
    assert job.returncode == -signal.SIGKILL
    assert not (out / "manifest.json").exists()
    with pytest.raises(ValueError, match="unfinished"):
        PreparedDataset(out)

    rerun = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    going_on = [line for line in rerun.stderr.splitlines() if line.startswith("Going on with")]
    assert len(going_on) == 1, rerun.stderr
    assert "Prepared " in rerun.stderr and "tokens/s" in rerun.stderr

    fresh = prepare_dataset(tmp_path / "fresh", [data], tokenizer=ByteTokenizer(), num_workers=0)
    prepared = PreparedDataset(out, tokenizer=ByteTokenizer())
    assert prepared.fingerprint == fresh.fingerprint
    assert prepared.tokens.tolist() == fresh.tokens.tolist()

    assert main(["verify-data", str(out)]) == 0
    assert "every file matches the manifest" in capsys.readouterr().out
    tokens = (out / "tokens.bin").read_bytes()
    (out / "tokens.bin").write_bytes(tokens[:100] + bytes([tokens[100] ^ 1]) + tokens[101:])
    assert main(["verify-data", str(out)]) == 2
    damaged = capsys.readouterr().err
    assert damaged.startswith(f"error: {out / 'tokens.bin'} does not match the manifest")
    assert len(damaged.strip().splitlines()) == 1


BAD_ARGUMENTS = {
    "The data path missing.jsonl does not exist": ["--tokenizer", "bytes", "missing.jsonl"],
    "Cannot load the tokenizer": ["--tokenizer", "no/such/tokenizer.json", "data.jsonl"],
    "num_workers must be zero or more": [
        "--tokenizer",
        "bytes",
        "data.jsonl",
        "--num-workers",
        "-1",
    ],
}


def test_bad_arguments_exit_2_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_jsonl(tmp_path / "data.jsonl", 10)
    monkeypatch.chdir(tmp_path)
    for nr, (message, arguments) in enumerate(BAD_ARGUMENTS.items()):
        command = ["prepare", f"out{nr}", *arguments]
        if nr == 0:
            # One in a process of its own, to show the terminal gets the one line and no more.
            result = run_python("-m", "runtime", *command, cwd=tmp_path)
        else:
            result = in_process(main, command)
        assert result.returncode == 2
        assert result.stderr.startswith(f"error: {message}"), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        assert not (tmp_path / f"out{nr}" / "manifest.json").exists()
