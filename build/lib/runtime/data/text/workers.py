"""Reading and tokenizing chunks of data files, in this process or in worker processes.

Workers are started with the ``spawn`` (or ``forkserver``) method and hold no position: a task is
a chunk, its result the chunk's tokens, so nothing is lost when a worker or the trainer dies. A
worker exits when it is told to, when the trainer process is gone (it waits on the parent's
sentinel), and it ignores Ctrl-C, which the trainer handles by closing its workers.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import weakref
from abc import ABC, abstractmethod
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, final

from typing_extensions import override

from runtime.data.data_reader import DataReaderError
from runtime.data.text.files import ChunkTokens, DataFile, ReadOptions, TextDataError, read_chunk

# A chunk to read: the file and the offsets [start, end) of its documents.
ChunkTask = tuple[DataFile, int, int]


class ChunkReader(ABC):
    """Reads chunks in the background (or not); results are claimed by ticket, in any order."""

    @abstractmethod
    def submit(self, task: ChunkTask) -> int:
        """Start reading ``task``; returns its ticket."""

    @abstractmethod
    def result(self, ticket: int) -> ChunkTokens:
        """The chunk of ``ticket``, waiting for it; raises :class:`TextDataError` if it is bad."""

    @abstractmethod
    def forget(self, ticket: int) -> None:
        """Drop the result of ``ticket``, which will not be claimed."""

    def close(self) -> None:  # noqa: B027 - reading inline holds nothing to release
        """Stop the workers, if any."""


@final
class InlineChunkReader(ChunkReader):
    """Reads each chunk in the calling thread when its result is claimed."""

    def __init__(self, options: ReadOptions) -> None:
        self._options = options
        self._tasks: dict[int, ChunkTask] = {}
        self._next_ticket = 0

    @override
    def submit(self, task: ChunkTask) -> int:
        self._next_ticket += 1
        self._tasks[self._next_ticket] = task
        return self._next_ticket

    @override
    def result(self, ticket: int) -> ChunkTokens:
        file, start, end = self._tasks.pop(ticket)
        return read_chunk(file, start, end, self._options)

    @override
    def forget(self, ticket: int) -> None:
        self._tasks.pop(ticket, None)


@final
class WorkerChunkReader(ChunkReader):
    """Reads chunks in ``num_workers`` processes, handing tasks to them in turn."""

    def __init__(
        self, options: ReadOptions, *, num_workers: int, start_method: str = "spawn"
    ) -> None:
        context = multiprocessing.get_context(start_method)
        self._processes: list[BaseProcess] = []
        self._connections: list[Connection] = []
        for worker_nr in range(num_workers):
            ours, theirs = context.Pipe()
            process = context.Process(  # type: ignore[attr-defined]
                target=_serve,
                args=(theirs, options),
                name=f"text-data-worker-{worker_nr}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self._processes.append(process)
            self._connections.append(ours)
        self._owner: dict[int, int] = {}  # ticket -> worker
        self._done: dict[int, ChunkTokens | str] = {}
        self._forgotten: set[int] = set()
        self._next_ticket = 0
        # Stops the workers when the reader is dropped or the interpreter exits.
        self._finalizer = weakref.finalize(self, _stop, self._processes, self._connections)

    @override
    def submit(self, task: ChunkTask) -> int:
        self._next_ticket += 1
        worker = self._next_ticket % len(self._processes)
        try:
            self._connections[worker].send((self._next_ticket, task))
        except (OSError, ValueError) as ex:
            raise self._worker_gone(worker) from ex
        self._owner[self._next_ticket] = worker
        return self._next_ticket

    @override
    def result(self, ticket: int) -> ChunkTokens:
        worker = self._owner[ticket]
        while ticket not in self._done:
            self._receive(worker)
        del self._owner[ticket]
        chunk = self._done.pop(ticket)
        if isinstance(chunk, str):
            raise TextDataError(chunk)
        return chunk

    @override
    def forget(self, ticket: int) -> None:
        if self._done.pop(ticket, None) is None and ticket in self._owner:
            self._forgotten.add(ticket)
        self._owner.pop(ticket, None)

    @override
    def close(self) -> None:
        self._finalizer()

    @property
    def processes(self) -> list[BaseProcess]:
        """The worker processes (stopped ones included, until :meth:`close`)."""
        return list(self._processes)

    def _receive(self, worker: int) -> None:
        connection, process = self._connections[worker], self._processes[worker]
        wait([connection, process.sentinel])
        try:
            ticket, chunk = connection.recv()
        except (EOFError, OSError) as ex:
            raise self._worker_gone(worker) from ex
        if ticket in self._forgotten:
            self._forgotten.discard(ticket)
        else:
            self._done[ticket] = chunk

    def _worker_gone(self, worker: int) -> DataReaderError:
        process = self._processes[worker]
        process.join(timeout=1.0)
        return DataReaderError(
            f"The text data worker process {process.name} (pid {process.pid}) exited with code "
            f"{process.exitcode} while reading; its output above says why. A worker that "
            'fails to start is often a script without an `if __name__ == "__main__":` guard '
            "(workers are spawned and import it); one killed may have run out of memory: use "
            "fewer num_workers, or num_workers=0 to read in the training process."
        )


def _serve(connection: Connection, options: ReadOptions) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    waitables: list[Any] = [connection] if parent is None else [connection, parent.sentinel]
    while True:
        ready = wait(waitables)
        if parent is not None and parent.sentinel in ready:
            return  # the trainer is gone; nobody will read the results
        try:
            task = connection.recv()
        except EOFError:
            return
        if task is None:
            return
        ticket, (file, start, end) = task
        result: ChunkTokens | str
        try:
            result = read_chunk(file, start, end, options)
        except Exception as ex:
            result = str(ex) if isinstance(ex, TextDataError) else f"{type(ex).__name__}: {ex}"
        try:
            connection.send((ticket, result))
        except OSError:
            return


def _stop(processes: list[BaseProcess], connections: list[Connection]) -> None:
    for connection in connections:
        with contextlib.suppress(OSError, ValueError):
            connection.send(None)
    for process in processes:
        process.join(timeout=5.0)
        if process.is_alive():
            process.terminate()
            process.join(timeout=5.0)
    for connection in connections:
        connection.close()


def make_chunk_reader(options: ReadOptions, *, num_workers: int) -> ChunkReader:
    """Worker processes when ``num_workers`` > 0, otherwise reading in the calling thread."""
    if num_workers == 0:
        return InlineChunkReader(options)
    return WorkerChunkReader(options, num_workers=num_workers)
