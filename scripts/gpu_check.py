"""The first run on a GPU machine, in one command: ``scripts/gpu_check.sh OUT_DIR``.

Runs each part below with its own time limit (``timeout``), inside a budget of 8 minutes on one
H100, and writes ``OUT_DIR/report.md``: the device, the torch and CUDA versions, each part
passed, failed, timed out or not run, with its figure and the path of its log. Parts come in
order of what a first run needs most; a part the budget has no time left for is not run, and
``--parts`` reruns chosen ones. A part that needs more GPUs than the machine has (``lm_sp2``
and ``lm_pp2``, two) is skipped with one line. ``--dry-run`` checks the parts on any machine
(their files, modules, config overrides and benchmark arguments) without running them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 450
"""All parts together; with the start-up and the report, the check ends within 8 minutes."""
KILL_AFTER_S = 10
"""How long a part has to end after its time limit's SIGTERM before SIGKILL."""


@dataclass(frozen=True)
class Outcome:
    returncode: int
    log: Path
    out: Path
    seconds: float


@dataclass(frozen=True)
class Part:
    name: str
    what: str
    command: list[str]
    timeout_s: int
    judge: Callable[[Outcome], tuple[bool, str]]
    """Whether the part passed, and its figure, from its exit status, log and outputs."""
    configs: list[tuple[str, str, list[str]]] = field(default_factory=list)
    """(module, config class, overrides) the dry run loads, as the part's command would."""
    needs_data: bool = False
    min_gpus: int = 1
    """A part that needs more GPUs than the machine has is skipped, in one line."""


# ----------------------------------------------------------------------------- figures


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def bench_result(log: Path) -> dict[str, Any] | None:
    """The ``BENCH_RESULT {...}`` line a benchmark worker prints, if it printed one."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    found = [line.split(" ", 1)[1] for line in lines if line.startswith("BENCH_RESULT ")]
    return json.loads(found[-1]) if found else None


def gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


def training_figure(outcome: Outcome) -> tuple[bool, str]:
    """A recipe's run: it finished and its loss went down; throughput, mfu, peak memory."""
    train = [r for r in read_jsonl(outcome.out / "metrics" / "train.jsonl") if "loss" in r]
    if not train:
        return False, "no train metrics published"
    last = train[-1]
    parts = [f"loss {train[0]['loss']:.3f} -> {last['loss']:.3f} at step {last['step_nr']}"]
    if "targets_per_second_per_device" in last:
        parts.append(f"{last['targets_per_second_per_device']:,.0f} tokens/s")
    if "mfu" in last:
        parts.append(f"MFU {last['mfu']:.1%}")
    if "peak_memory_bytes" in last:
        parts.append(f"peak memory {gib(last['peak_memory_bytes'])}")
    learned = last["loss"] < train[0]["loss"]
    return outcome.returncode == 0 and learned, ", ".join(parts)


def oom_figure(outcome: Outcome) -> tuple[bool, str]:
    """The provoked out-of-memory ends the run with one StepOutOfMemoryError."""
    text = outcome.log.read_text(errors="replace") if outcome.log.is_file() else ""
    rank_log = outcome.out / "logs" / "rank_0.log"
    text += rank_log.read_text(errors="replace") if rank_log.is_file() else ""
    lines = [line for line in text.splitlines() if "StepOutOfMemoryError: " in line]
    if outcome.returncode == 0 or not lines:
        return False, "no StepOutOfMemoryError"
    return "Step 7 ran out of device memory" in lines[-1], lines[-1].strip()[:200]


def pytest_figure(outcome: Outcome) -> tuple[bool, str]:
    """The suite's counts (from its verbose lines, so a suite stopped at its limit has them
    too) and the figures its tests print."""
    text = outcome.log.read_text(errors="replace") if outcome.log.is_file() else ""
    counts = {
        word: sum(f" {word.upper()}" in line for line in text.splitlines())
        for word in ("passed", "failed", "error", "skipped")
    }
    figures = [line.split("] ", 1)[1] for line in text.splitlines() if "[cuda figure] " in line]
    summary = ", ".join(f"{n} {word}" for word, n in counts.items() if n)
    ok = outcome.returncode == 0 and counts["passed"] > 0
    return ok, "; ".join([summary or "no test ran", *figures])


def bench_figure(keys: tuple[str, ...]) -> Callable[[Outcome], tuple[bool, str]]:
    def judge(outcome: Outcome) -> tuple[bool, str]:
        result = bench_result(outcome.log)
        if result is None:
            return False, "no BENCH_RESULT line"
        shown = [f"{k} {result[k]:.4g}" for k in keys if k in result]
        return outcome.returncode == 0, ", ".join(shown)

    return judge


def paired_figure(outcome: Outcome) -> tuple[bool, str]:
    path = outcome.out / "results.json"
    if not path.is_file():
        return False, "no results.json"
    (comparison,) = json.loads(path.read_text())["comparisons"]
    metrics = comparison["contenders"][0]["metrics"]
    shown = [
        f"{key} {stats.get('median', stats.get('mean')):.4g}"
        for key, stats in metrics.items()
        if key in ("ratio", "trainer_step_s", "hand_step_s")
    ]
    return outcome.returncode == 0 and bool(shown), ", ".join(shown)


# ----------------------------------------------------------------------------- the parts

PYTHON = sys.executable
CHAR_LM_STEPS = 300
LM_1B = [
    "model.name=llama_1b",
    "data.seq_len=2048",
    "data.batch_size=4",
    "data.num_workers=0",
    "trainer.max_num_steps=30",
    "trainer.publish_metrics_every_n_steps=10",
    "trainer.checkpoint_every_n_steps=1000",
    "trainer.keep_last_n_checkpoints=1",
    "trainer.gc_every_n_steps=null",
    "optimizer.warmup_steps=5",
    "data_parallel=fsdp",
    "fsdp.param_dtype=bfloat16",
    "fsdp.reduce_dtype=float32",
    "trainer.amp=false",
]
"""llama_1b (1 B parameters with the byte tokenizer) on 4 x 2048 tokens a step, under FSDP2 on
one GPU (a mesh of one): bf16 parameters and compute, float32 gradient reduction, float32
sharded weights and AdamW state. No autocast on top: the blocks already compute in bf16."""
LM_1B_SP2 = [
    *(o for o in LM_1B if not o.startswith(("data.seq_len=", "data.batch_size="))),
    "data.seq_len=16384",
    "data.batch_size=1",
    "gang.sp_size=2",
    "model.activation_checkpointing=true",
]
"""llama_1b on one sequence of 16k tokens a step, split over two GPUs by sequence parallelism
(Ulysses all-to-alls over nccl), FSDP2 over the two SP ranks as above."""


LM_PP2 = [
    *[o for o in LM_1B if not o.startswith(("data_parallel=", "fsdp.", "trainer.max_num_steps="))],
    "trainer.max_num_steps=20",
    "gang.pp_size=2",
    "pipeline.schedule=1f1b",
    "pipeline.num_microbatches=4",
]
"""llama_1b on the data of :data:`LM_1B`, 20 steps under pipeline parallelism over two GPUs
instead of FSDP2: each holds half the layers, in float32."""


def recipe(module: str, out: Path, overrides: list[str]) -> list[str]:
    return [PYTHON, "-m", module, str(out), "--config", *overrides]


def torchrun(nproc: int, module: str, out: Path, overrides: list[str]) -> list[str]:
    """``recipe``'s command on ``nproc`` processes of one machine, one GPU each."""
    return [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", module, str(out), "--config", *overrides]  # fmt: skip


def make_parts(out_dir: Path) -> list[Part]:
    """The parts, in the order they run: what a first run needs most comes first."""
    data = out_dir / "data" / "train.txt"
    char_lm = [
        f"trainer.max_num_steps={CHAR_LM_STEPS}",
        "trainer.validate_every_n_steps=100",
        f"trainer.checkpoint_every_n_steps={CHAR_LM_STEPS}",
        "trainer.publish_metrics_every_n_steps=50",
    ]
    lm = [f"data.train={data}", *LM_1B, "model.activation_checkpointing=false"]
    lm_ac = [f"data.train={data}", *LM_1B, "model.activation_checkpointing=true"]
    lm_sp2 = [f"data.train={data}", *LM_1B_SP2]
    oom = ["max_num_steps=12", "checkpoint_every=5", "oom_at_step=7"]
    lm_pp2 = [f"data.train={data}", *LM_PP2]
    cuda_run = "tests/cuda/cuda_run.py"

    def at(name: str) -> Path:
        return out_dir / name

    gpu_worker = [PYTHON, "-m", "benchmarks.gpu_worker"]
    return [
        Part("char_lm", f"char-LM recipe on cuda:0, {CHAR_LM_STEPS} steps",
             recipe("recipes.char_lm", at("char_lm"), char_lm), 90, training_figure,
             [("recipes.char_lm", "CharLMConfig", char_lm)]),
        Part("oom", "a StepOutOfMemoryError provoked at step 7 (tests/cuda/cuda_run.py)",
             [PYTHON, cuda_run, str(at("oom")), "--config", *oom], 60, oom_figure,
             [("tests.cuda.cuda_run", "CudaRunConfig", oom)]),
        Part("cuda_suite", "the CUDA test suite (pytest -m cuda tests/cuda)",
             [PYTHON, "-m", "pytest", "-v", "-rP", "-p", "no:cacheprovider", "-m", "cuda",
              "tests/cuda", "--basetemp", str(at("cuda_suite"))], 240, pytest_figure),
        Part("lm_1b", "recipes.lm llama_1b, FSDP2 bf16 (fp32 reduce), no activation checkpointing",
             recipe("recipes.lm", at("lm_1b"), lm), 120, training_figure,
             [("recipes.lm", "LMConfig", lm)], needs_data=True),
        Part("lm_1b_ac", "recipes.lm llama_1b, FSDP2 bf16 (fp32 reduce), activation checkpointing",
             recipe("recipes.lm", at("lm_1b_ac"), lm_ac), 120, training_figure,
             [("recipes.lm", "LMConfig", lm_ac)], needs_data=True),
        Part("lm_sp2", "recipes.lm llama_1b, 16k-token sequences split over 2 GPUs (SP=2, FSDP2 "
             "bf16, activation checkpointing)",
             torchrun(2, "recipes.lm", at("lm_sp2"), lm_sp2), 120, training_figure,
             [("recipes.lm", "LMConfig", lm_sp2)], needs_data=True, min_gpus=2),
        Part("bench_1b_hand", "G2: the 1.1 B Llama, hand-written loop (compiled, bf16)",
             [*gpu_worker, "--loop", "hand"], 120,
             bench_figure(("tokens_per_s", "mfu", "peak_memory_bytes"))),
        Part("bench_1b_trainer", "G2: the 1.1 B Llama, the Trainer (compiled, bf16)",
             [*gpu_worker, "--loop", "trainer"], 120,
             bench_figure(("tokens_per_s", "mfu", "peak_memory_bytes"))),
        Part("bench_overhead", "G1: step overhead, Trainer / hand-written loop (paired)",
             [PYTHON, "-m", "benchmarks", "--runs", "1", "--cases", "G1-paired",
              "--output-dir", str(at("bench_overhead"))], 90, paired_figure),
        Part("bench_checkpoint", "G2 checkpoint: async save of 13 GB, caller's blocking time",
             [*gpu_worker, "--checkpoint"], 120,
             bench_figure(("async_blocked_s", "async_blocked_later_s", "save_gb_per_s",
                           "load_gb_per_s"))),
        # Last: on a machine of two GPUs it takes what the budget has left.
        Part("lm_pp2", "recipes.lm llama_1b under PP=2 (1F1B, 4 microbatches) on 2 GPUs",
             torchrun(2, "recipes.lm", at("lm_pp2"), lm_pp2), 150, training_figure,
             [("recipes.lm", "LMConfig", lm_pp2)], needs_data=True, min_gpus=2),
    ]  # fmt: skip


def write_lm_data(path: Path, num_bytes: int = 4_000_000) -> None:
    """Text for recipes.lm: the Python standard library's sources, as the char LM reads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    chunks, size = [], 0
    for source in sorted(Path(os.__file__).parent.glob("*.py")):
        text = source.read_text(errors="replace")
        chunks.append(text)
        size += len(text)
        if size >= num_bytes:
            break
    path.write_text("\n".join(chunks))


# ----------------------------------------------------------------------------- running


@dataclass
class Row:
    part: Part
    status: str
    figure: str = ""
    seconds: float = 0.0
    log: Path | None = None


def run_part(part: Part, out_dir: Path, limit_s: int) -> Row:
    """Run ``part`` under ``timeout`` (SIGTERM at the limit, SIGKILL after KILL_AFTER_S)."""
    log = out_dir / "logs" / f"{part.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = ["timeout", "-k", str(KILL_AFTER_S), str(limit_s), *part.command]
    start = time.monotonic()
    with log.open("w") as sink:
        sink.write(f"$ {' '.join(part.command)}\n")
        sink.flush()
        returncode = subprocess.call(command, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    outcome = Outcome(returncode, log, out_dir / part.name, time.monotonic() - start)
    try:
        passed, figure = part.judge(outcome)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as ex:
        passed, figure = False, f"its figure could not be read: {type(ex).__name__}: {ex}"
    if returncode in (124, 137):
        status = f"timed out ({limit_s} s)"
    else:
        status = "passed" if passed else f"failed (exit {returncode})"
    return Row(part, status, figure, outcome.seconds, log)


def run_parts(parts: list[Part], out_dir: Path, budget_s: float) -> list[Row]:
    deadline = time.monotonic() + budget_s
    rows = []
    for part in parts:
        left = int(deadline - time.monotonic()) - KILL_AFTER_S
        if left < min(part.timeout_s, 30):
            rows.append(Row(part, "not run: the budget is spent; rerun with --parts " + part.name))
            continue
        if part.min_gpus > 1 and (found := gpu_count()) < part.min_gpus:
            status = f"skipped: needs {part.min_gpus} GPUs, this machine has {found}"
            print(f"gpu_check: {part.name}: {status}.", flush=True)
            rows.append(Row(part, status))
            continue
        if part.needs_data and not (out_dir / "data" / "train.txt").is_file():
            write_lm_data(out_dir / "data" / "train.txt")
        print(f"gpu_check: {part.name} (at most {min(part.timeout_s, left)} s) ...", flush=True)
        row = run_part(part, out_dir, min(part.timeout_s, left))
        print(f"gpu_check: {part.name}: {row.status}. {row.figure}", flush=True)
        rows.append(row)
    return rows


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def skipped(row: Row) -> bool:
    """Whether ``row``'s part was left out for want of GPUs (no failure)."""
    return row.status.startswith("skipped: ")


def describe_machine() -> list[str]:
    import torch

    lines = [
        f"- Python {platform.python_version()}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
        f"NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else '-'}"
    ]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.insert(0, f"- Device: {props.name}, {gib(props.total_memory)}, "
                     f"{props.multi_processor_count} SMs, {torch.cuda.device_count()} GPU(s)")  # fmt: skip
    else:
        lines.insert(0, "- Device: no CUDA device here")
    smi = shutil.which("nvidia-smi")
    if smi:
        query = [smi, "--query-gpu=driver_version", "--format=csv,noheader"]
        driver = subprocess.run(query, capture_output=True, text=True, check=False).stdout
        lines.append(f"- Driver: {driver.strip() or 'unknown'}")
    return lines


def trainer_against_hand(out_dir: Path) -> list[str]:
    """The G2 goal's figure: the Trainer's tokens per second over the hand-written loop's."""
    hand = bench_result(out_dir / "logs" / "bench_1b_hand.log")
    trainer = bench_result(out_dir / "logs" / "bench_1b_trainer.log")
    if not hand or not trainer or not hand.get("tokens_per_s"):
        return []
    ratio = trainer.get("tokens_per_s", 0.0) / hand["tokens_per_s"]
    return [f"- G2, 1.1 B Llama: Trainer / hand-written loop tokens per second = {ratio:.3f} "
            "(goal: >= 0.98)"]  # fmt: skip


def write_report(out_dir: Path, rows: list[Row], header: list[str], title: str) -> Path:
    lines = [f"# {title}", "", *header, "", "| part | what | result | figure | time | log |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for row in rows:
        log = str(row.log.relative_to(out_dir)) if row.log else "-"
        cells = [row.part.name, row.part.what, row.status, row.figure.replace("|", "/") or "-",
                 f"{row.seconds:.0f} s" if row.seconds else "-", log]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# ----------------------------------------------------------------------------- the dry run


def check_part(part: Part) -> list[str]:
    """What would stop ``part`` from starting: a missing module or file, a config override its
    recipe refuses, a benchmark case or loop that does not exist."""
    import importlib
    import importlib.util

    problems = []
    command = part.command[1:]
    if command[0] == "-m":
        if importlib.util.find_spec(command[1]) is None:
            problems.append(f"no module {command[1]}")
    elif not (REPO_ROOT / command[0]).is_file():
        problems.append(f"no file {command[0]}")
    for module, class_name, overrides in part.configs:
        from runtime.cli.config import ConfigError, load_config

        config_class = getattr(importlib.import_module(module), class_name)
        try:
            load_config(config_class, overrides=overrides)
        except ConfigError as ex:
            problems.append(f"{module}: {ex}")
    if "--loop" in command:
        from benchmarks.gpu_worker import LOOP_NAMES

        if command[command.index("--loop") + 1] not in LOOP_NAMES:
            problems.append(f"no loop {command[command.index('--loop') + 1]}")
    if "--cases" in command:
        from benchmarks.cases import CASE_KEYS

        unknown = set(command[command.index("--cases") + 1].split(",")) - set(CASE_KEYS)
        problems += [f"no benchmark case {case}" for case in sorted(unknown)]
    for arg in command:
        if arg.startswith("tests/") and not (REPO_ROOT / arg).exists():
            problems.append(f"no {arg}")
    return problems


def dry_run(parts: list[Part], out_dir: Path) -> int:
    write_lm_data(out_dir / "data" / "train.txt", num_bytes=100_000)
    rows, failed = [], False
    if shutil.which("timeout") is None:
        print("gpu_check: no `timeout` command here (coreutils).", file=sys.stderr)
        failed = True
    for part in parts:
        problems = check_part(part)
        failed = failed or bool(problems)
        status = "checked" if not problems else "broken: " + "; ".join(problems)
        rows.append(Row(part, status, f"at most {part.timeout_s} s"))
        print(f"gpu_check --dry-run: {part.name}: {status}", flush=True)
        print(f"  $ {shlex.join(part.command)}", flush=True)
    total = sum(part.timeout_s for part in parts)
    header = [f"- Dry run: {len(parts)} parts, {total} s of time limits in a {BUDGET_S} s budget"]
    print(
        f"gpu_check --dry-run: wrote {write_report(out_dir, rows, header, 'GPU check (dry run)')}"
    )
    return 1 if failed else 0


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__)
    parser.add_argument("out_dir", type=Path, help="where the report, logs and runs go")
    parser.add_argument("--dry-run", action="store_true", help="check the parts, run none")
    parser.add_argument("--parts", help="comma-separated parts to run (default: all, in order)")
    args = parser.parse_args(argv)
    out_dir = args.out_dir.resolve()
    parts = make_parts(out_dir)
    if args.parts:
        names = [part.name for part in parts]
        unknown = sorted(set(args.parts.split(",")) - set(names))
        if unknown:
            parser.error(f"--parts must name parts of {', '.join(names)}, but has {unknown}.")
        parts = [part for part in parts if part.name in args.parts.split(",")]
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        return dry_run(parts, out_dir)
    started = time.monotonic()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    header = [f"- Run: {stamp}, parts {', '.join(p.name for p in parts)}", *describe_machine()]
    rows = run_parts(parts, out_dir, BUDGET_S - (time.monotonic() - started))
    header.append(f"- Parts took {time.monotonic() - started:.0f} s of a {BUDGET_S} s budget")
    header += trainer_against_hand(out_dir)
    report = write_report(out_dir, rows, header, "GPU check")
    # The logs in one small file, to carry back beside the report.
    shutil.make_archive(str(out_dir / "logs"), "gztar", out_dir, "logs")
    print(f"gpu_check: wrote {report} and {out_dir / 'logs.tar.gz'}", flush=True)
    return 0 if all(row.status == "passed" or skipped(row) for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
