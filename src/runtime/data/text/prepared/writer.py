"""Preparing a text dataset: tokenize the files once, in worker processes, into token files.

The files are cut into the chunks the text reader reads (see :mod:`runtime.data.text.files`).
All unfinished work lives in ``DIR/.prepare/``, made before anything else, so that a rerun knows
the writer's own files from a user's. The steps, any of which a kill can cut short:

1. ``.prepare/plan.json``: the sources with their digests, the tokenizer and the options.
2. ``.prepare/chunks/``: each finished chunk, saved under a ``.partial`` name and renamed.
3. ``.prepare/tokens.bin`` and ``documents.bin``, the chunks joined in file order, then
   ``.prepare/manifest.json``, which marks the join done.
4. ``tokens.bin`` and ``documents.bin`` renamed into ``DIR``, then ``manifest.json``. Its rename
   is the one commit point: a directory reads as a dataset only once everything it names is there.
5. ``.prepare/`` removed.

The same command run again finishes from wherever it stopped: past step 4 it finds the dataset
and removes what is left of ``.prepare/``; with the join done it redoes only the renames it
missed; before that it tokenizes the chunks not yet saved. Work planned for other inputs or
settings is discarded, with the files it had moved into ``DIR``, and the preparation starts over.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, final

import numpy as np

from runtime.data.text.files import DataFile, ReadOptions, chunk_ends, find_files
from runtime.data.text.prepared.format import (
    DOCUMENTS_FILE,
    MANIFEST_FILE,
    TOKENS_FILE,
    WORK_DIR,
    PreparedDataError,
    PreparedDataset,
    file_digest,
    read_manifest,
    token_dtype,
    tokenizer_entry,
    write_manifest,
)
from runtime.data.text.tokenizer import Tokenizer
from runtime.data.text.workers import make_chunk_reader
from trainkit_utils.arguments import check_not_negative, check_positive
from trainkit_utils.files import fsync_dir, write_json_durably

log = logging.getLogger(__name__)

_PLAN_FILE = "plan.json"
_PIECES_DIR = "chunks"
_JOINED_FILES = (TOKENS_FILE, DOCUMENTS_FILE)


@final
@dataclass(frozen=True)
class _Task:
    """A chunk of a source file, and the share of the corpus's bytes it stands for."""

    name: str
    file: DataFile
    start: int
    end: int
    num_bytes: float


def prepare_dataset(
    output_dir: str | Path,
    inputs: Sequence[str | Path],
    *,
    tokenizer: Tokenizer,
    text_field: str = "text",
    skip_bad_lines: bool = False,
    add_bos: bool = True,
    num_workers: int | None = None,
    chunk_bytes: int = 8 << 20,
    report: Callable[[str], None] | None = None,
) -> PreparedDataset:
    """Tokenize the ``.jsonl``, ``.txt`` and ``.parquet`` files of ``inputs`` into a prepared
    dataset in ``output_dir`` and open it.

    The documents, their fields and bad lines are read as :class:`TextDataReader` reads them.
    ``num_workers`` processes tokenize (default: one per core; 0: this process). ``report``
    gets a progress line every few seconds. A directory that already holds this dataset (the
    same inputs by their bytes, however their paths are spelled) is opened as it is; one that an
    earlier run left unfinished is finished; one holding another dataset, or files of its own,
    is refused.
    """
    check_not_negative("num_workers", num_workers or 0)
    check_positive("chunk_bytes", chunk_bytes)
    output_dir = Path(output_dir)
    options = ReadOptions(
        tokenizer=tokenizer,
        text_field=text_field,
        skip_bad_lines=skip_bad_lines,
        add_bos=add_bos,
        chunk_bytes=chunk_bytes,
    )
    files = _unique_files(inputs)
    plan = _plan(files, options)
    if _finished_with(output_dir, plan):
        if report is not None:
            report(f"{output_dir} already holds this dataset, prepared from the same inputs.")
        return PreparedDataset(output_dir, tokenizer=tokenizer)

    work = output_dir / WORK_DIR
    _start_work(output_dir, plan, report)
    tasks = _tasks(files, options)
    todo = [task for task in tasks if not (work / _PIECES_DIR / task.name).is_file()]
    if report is not None and len(todo) < len(tasks):
        report(f"Going on with {len(todo)} of {len(tasks)} chunks; the others are done.")
    workers = (os.cpu_count() or 1) if num_workers is None else num_workers
    progress = _Progress(
        total_bytes=sum(task.num_bytes for task in tasks),
        done_bytes=sum(task.num_bytes for task in tasks) - sum(task.num_bytes for task in todo),
        report=report,
    )
    if not (work / MANIFEST_FILE).is_file():  # else the chunks are joined already
        _tokenize(todo, options, work / _PIECES_DIR, num_workers=workers, progress=progress)
        _join(work, tasks, plan)
    manifest = _publish(work, output_dir)
    _remove_work(output_dir)
    if report is not None:
        progress.finish(manifest, output_dir)
    return PreparedDataset(output_dir, tokenizer=tokenizer)


def _plan(files: Sequence[DataFile], options: ReadOptions) -> dict[str, Any]:
    """What the manifest records of how the dataset is made: the sources (path, size and
    digest), the tokenizer, the options and the token dtype."""
    return {
        "sources": [
            {
                "path": file.path,
                "size": os.path.getsize(file.path),
                "digest": file_digest(Path(file.path)),
            }
            for file in files
        ],
        "tokenizer": tokenizer_entry(options.tokenizer),
        "text_field": options.text_field,
        "skip_bad_lines": options.skip_bad_lines,
        "add_bos": options.add_bos,
        "dtype": token_dtype(options.tokenizer.vocab_size).name,
    }


def _unique_files(inputs: Sequence[str | Path]) -> list[DataFile]:
    if not inputs:
        raise ValueError(
            "No input files are given. Give .jsonl, .txt or .parquet files to prepare."
        )
    found: dict[str, DataFile] = {}
    for path in inputs:
        for file in find_files(path):
            found.setdefault(os.path.abspath(file.path), file)
    return list(found.values())


def _differences(recorded: Mapping[str, Any], plan: Mapping[str, Any]) -> list[str]:
    """The entries of ``plan`` that ``recorded`` (a manifest, or unfinished work's plan) has
    otherwise."""
    return [key for key in plan if _decisive(key, recorded.get(key)) != _decisive(key, plan[key])]


def _decisive(key: str, value: Any) -> Any:
    """What of a plan's entry decides the dataset. Sources count by their bytes (size and digest,
    in order), not by their paths: ``a.jsonl``, ``./a.jsonl``, its absolute path or a link to it
    are one input and make the same tokens, while a file whose bytes changed is another."""
    if key != "sources" or not isinstance(value, list):
        return value
    return [
        (source.get("size"), source.get("digest")) if isinstance(source, dict) else source
        for source in value
    ]


def _finished_with(output_dir: Path, plan: dict[str, Any]) -> bool:
    """Whether ``output_dir`` holds this very dataset; refuses one that holds something else."""
    if not output_dir.exists():
        return False
    if not output_dir.is_dir():
        raise PreparedDataError(f"The output {output_dir} is a file. Give a directory.")
    work = output_dir / WORK_DIR
    if (output_dir / MANIFEST_FILE).is_file():
        differ = _differences(read_manifest(output_dir), plan)
        if differ:
            raise PreparedDataError(
                f"{output_dir} already holds a prepared dataset of other inputs or settings (the "
                f"{', '.join(differ)} differ). Give another output directory, or delete this one "
                "first."
            )
        _remove_work(output_dir)  # a kill after the commit point can leave some of it
        return True
    # Beside its work directory, the files the writer moves out of it are its own; the rest is not.
    own = {WORK_DIR, *_JOINED_FILES} if work.is_dir() else set()
    foreign = sorted(entry.name for entry in output_dir.iterdir() if entry.name not in own)
    if foreign:
        raise PreparedDataError(
            f"{output_dir} is not empty and holds no prepared dataset (it has {foreign[:3]}). "
            "Give a new or empty output directory."
        )
    return False


def _start_work(
    output_dir: Path, plan: dict[str, Any], report: Callable[[str], None] | None
) -> None:
    """Keep the unfinished work of the same plan; discard any other and start over."""
    work = output_dir / WORK_DIR
    if work.is_dir():
        problem = _why_not_resumable(output_dir, plan)
        if problem is None:
            return
        if report is not None:
            report(f"Discarding the unfinished preparation in {work}: {problem}.")
        _remove_work(output_dir, with_moved_files=True)
    (work / _PIECES_DIR).mkdir(parents=True, exist_ok=True)
    write_json_durably(plan, work / _PLAN_FILE)


def _why_not_resumable(output_dir: Path, plan: dict[str, Any]) -> str | None:
    """Why the unfinished work in ``output_dir`` cannot be finished for ``plan``; None if it can."""
    work = output_dir / WORK_DIR
    try:
        recorded = json.loads((work / _PLAN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "it has no plan (it was stopped as it began, or while being removed)"
    if not isinstance(recorded, dict) or _differences(recorded, plan):
        return "it had other inputs or settings"
    joined = (work / MANIFEST_FILE).is_file()
    if joined and not all(
        (work / n).is_file() or (output_dir / n).is_file() for n in _JOINED_FILES
    ):
        return "its joined files are missing"
    return None


def _remove_work(output_dir: Path, *, with_moved_files: bool = False) -> None:
    """Remove the unfinished work, and with ``with_moved_files`` the files it had moved into
    ``output_dir``: those first, so that a kill in between leaves them beside the work that marks
    them as the writer's."""
    if with_moved_files:
        for name in _JOINED_FILES:
            (output_dir / name).unlink(missing_ok=True)
    if (output_dir / WORK_DIR).exists():
        shutil.rmtree(output_dir / WORK_DIR)


def _tasks(files: Sequence[DataFile], options: ReadOptions) -> list[_Task]:
    tasks = []
    for file_nr, file in enumerate(files):
        ends = chunk_ends(file, options)
        size = os.path.getsize(file.path)
        units = ends[-1] if ends else 1  # bytes, or rows of a Parquet file
        for chunk_nr, (start, end) in enumerate(zip([0, *ends], ends, strict=False)):
            name = f"{file_nr:06d}-{chunk_nr:06d}.npz"
            tasks.append(_Task(name, file, start, end, size * (end - start) / units))
    return tasks


def _tokenize(
    tasks: Sequence[_Task],
    options: ReadOptions,
    pieces: Path,
    *,
    num_workers: int,
    progress: _Progress,
) -> None:
    """Tokenize the chunks, ``2 * num_workers`` in flight, saving each one as it is done."""
    if not tasks:
        return  # no worker processes for nothing
    dtype = token_dtype(options.tokenizer.vocab_size)
    reader = make_chunk_reader(options, num_workers=num_workers)
    try:
        pending: deque[tuple[_Task, int]] = deque()
        queue = iter(tasks)
        while True:
            while len(pending) < max(2 * num_workers, 1) and (task := next(queue, None)):
                pending.append((task, reader.submit((task.file, task.start, task.end))))
            if not pending:
                return
            task, ticket = pending.popleft()
            chunk = reader.result(ticket)
            tokens = np.frombuffer(chunk.tokens, dtype=np.int32)
            if tokens.size and int(tokens.max()) >= options.tokenizer.vocab_size:
                raise PreparedDataError(
                    f"The tokenizer gave the id {int(tokens.max())} in {task.file.path}, but its "
                    f"vocab_size is {options.tokenizer.vocab_size}. Fix the tokenizer's vocab_size."
                )
            if chunk.first_bad_line is not None:
                log.warning(
                    "Skipped %d bad lines, the first: %s", chunk.num_bad_lines, chunk.first_bad_line
                )
            _save_piece(
                pieces / task.name,
                tokens=tokens.astype(dtype),
                lengths=np.asarray(chunk.lengths, dtype=np.int64),
                num_bad_lines=chunk.num_bad_lines,
            )
            progress.update(
                task.num_bytes, num_documents=len(chunk.lengths), num_tokens=tokens.size
            )
    finally:
        reader.close()


def _save_piece(path: Path, **arrays: Any) -> None:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as file:
        np.savez(file, **arrays)
    os.replace(partial, path)


def _join(work: Path, tasks: Sequence[_Task], plan: dict[str, Any]) -> None:
    """Join the chunks in order into the dataset's files in ``work``, then write their manifest
    there: it marks the join done."""
    import xxhash

    digests = {TOKENS_FILE: xxhash.xxh3_128(), DOCUMENTS_FILE: xxhash.xxh3_128()}
    num_tokens = num_documents = num_bad_lines = 0
    with (
        open(work / TOKENS_FILE, "wb") as tokens_out,
        open(work / DOCUMENTS_FILE, "wb") as ends_out,
    ):
        for task in tasks:
            with np.load(work / _PIECES_DIR / task.name, allow_pickle=False) as piece:
                tokens, lengths = piece["tokens"], piece["lengths"]
                num_bad_lines += int(piece["num_bad_lines"])
            ends = (np.cumsum(lengths) + num_tokens).astype("<i8")
            for name, out, data in (
                (TOKENS_FILE, tokens_out, tokens),
                (DOCUMENTS_FILE, ends_out, ends),
            ):
                buffer = data.tobytes()
                out.write(buffer)
                digests[name].update(buffer)
            num_tokens += int(tokens.size)
            num_documents += int(lengths.size)
        for out in (tokens_out, ends_out):
            out.flush()
            os.fsync(out.fileno())
    if num_documents == 0:
        raise PreparedDataError(
            f"The inputs ({', '.join(source['path'] for source in plan['sources'][:3])}) hold no "
            "document to prepare. Check the files and text_field."
        )
    itemsize = np.dtype(plan["dtype"]).itemsize
    sizes = {TOKENS_FILE: num_tokens * itemsize, DOCUMENTS_FILE: num_documents * 8}
    write_manifest(
        work,
        plan,
        num_tokens=num_tokens,
        num_documents=num_documents,
        num_bad_lines=num_bad_lines,
        files={name: {"size": sizes[name], "digest": digests[name].hexdigest()} for name in sizes},
    )


def _publish(work: Path, output_dir: Path) -> dict[str, Any]:
    """Move the joined files into ``output_dir``, and their manifest last: its rename is the
    commit point. A move done before a kill is not redone, so a rerun finishes from any point."""
    for name in _JOINED_FILES:
        if (work / name).is_file():
            os.replace(work / name, output_dir / name)
    fsync_dir(output_dir)  # the files are in place on disk before a manifest names them
    os.replace(work / MANIFEST_FILE, output_dir / MANIFEST_FILE)
    fsync_dir(output_dir)
    return read_manifest(output_dir)


@final
class _Progress:
    """Documents, tokens a second and the time left, reported every few seconds."""

    def __init__(
        self,
        *,
        total_bytes: float,
        done_bytes: float,
        report: Callable[[str], None] | None,
        every_seconds: float = 5.0,
    ) -> None:
        self._total_bytes = max(total_bytes, 1.0)
        self._done_bytes = done_bytes
        self._start_bytes = done_bytes
        self._report = report
        self._every = every_seconds
        self._start = self._last = time.monotonic()
        self.num_documents = self.num_tokens = 0

    def update(self, num_bytes: float, *, num_documents: int, num_tokens: int) -> None:
        self._done_bytes += num_bytes
        self.num_documents += num_documents
        self.num_tokens += num_tokens
        now = time.monotonic()
        if self._report is None or now - self._last < self._every:
            return
        self._last = now
        elapsed = now - self._start
        rate = (self._done_bytes - self._start_bytes) / elapsed
        left = (self._total_bytes - self._done_bytes) / rate if rate > 0 else float("nan")
        self._report(
            f"{self.num_documents:,} documents, {self.num_tokens:,} tokens "
            f"({self.num_tokens / elapsed:,.0f} tokens/s), "
            f"{100 * self._done_bytes / self._total_bytes:.0f}% of {_gigabytes(self._total_bytes)}, "
            f"{_duration(left)} left"
        )

    def finish(self, manifest: dict[str, Any], output_dir: Path) -> None:
        assert self._report is not None
        elapsed = time.monotonic() - self._start
        self._report(
            f"Prepared {output_dir}: {manifest['num_documents']:,} documents, "
            f"{manifest['num_tokens']:,} tokens ({manifest['dtype']}) from "
            f"{len(manifest['sources'])} files in {elapsed:.1f} s "
            f"({self.num_tokens / max(elapsed, 1e-9):,.0f} tokens/s tokenized)"
            + (
                f"; {manifest['num_bad_lines']} bad lines skipped"
                if manifest["num_bad_lines"]
                else ""
            )
            + "."
        )


def _gigabytes(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.2f} GB"


def _duration(seconds: float) -> str:
    if seconds != seconds:  # NaN: no rate yet
        return "?"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"
