"""DCP's file system writer and reader, made to hash what they write and to unpickle safely.

Two ways through DCP, chosen by :func:`fast_io_supported` alone:

- the fast one, for the torch versions it is tested with
  (:data:`gangs.torch_versions.TESTED_TORCH_VERSIONS`): it stages asynchronous saves into reused
  buffers, hashes files as a load reads them, and reads whole tensors in place
  (:func:`read_items`). It leans on DCP internals that change between
  torch releases, imported only where that path runs.
- the public one, on any other torch (or with ``TRAINKIT_CHECKPOINT_IO=public``): DCP's public
  writer, reader and planners only; a load's files are hashed after it, in a second read.

Both write the same files. Imports ``torch.distributed.checkpoint`` (slow to load), so
:mod:`checkpoint.storage` imports this module when a checkpoint is first written or read.

The in-place reads: DCP's ``FileSystemReader`` loads a tensor entry with ``torch.load`` into a
fresh tensor and copies that into the state dict's: every byte is copied twice, the first time
into memory the kernel must fault in page by page. Here an entry saved whole (a contiguous
tensor, as DCP saves them) and loaded whole into a contiguous CPU tensor of its dtype and shape
is read from the file into that tensor directly: ``torch.load(map_location="meta",
weights_only=True)`` reads only the entry's header to say what it holds, and the zip directory
says where its bytes are (on torch 2.13 and later: before it, every entry loads as DCP loads it,
see :data:`gangs.torch_versions.PRIVATE_APIS_SINCE`). Every other entry (a slice, a resharded or
cast one, bytes) loads as DCP loads it. Nothing is trusted more than before: the header is read ``weights_only``, the
bytes land only in a tensor whose size they must fill exactly, and the file's digest is checked
after the load as it always is (see :mod:`checkpoint.manifest`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import os
import pickle
import sys
import warnings
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final, TypeAlias, cast, final

import torch
from torch.autograd.graph import increment_version
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from checkpoint.directory import libc_function
from checkpoint.errors import CheckpointError
from checkpoint.integrity import (
    FileDigest,
    HashingReader,
    HashingStream,
    ReadDigests,
    assign_hashing,
)
from gangs.torch_versions import private_api_present, private_path_chosen

if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import _StorageInfo, _StorageReaderTransforms

_METADATA_MODULES = frozenset(
    {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"}
)
_PATH_CLASSES = frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"})

Gather: TypeAlias = Callable[[Any], list[Any]]

IO_ENV_VAR: Final = "TRAINKIT_CHECKPOINT_IO"
"""``public`` forces the public path; ``fast`` the fast one (tests); unset chooses by version."""


def fast_io_supported() -> bool:
    """Whether checkpoints go through the fast path (see the module docstring)."""
    return private_path_chosen(IO_ENV_VAR, private="fast", error=CheckpointError)


@final
class _HashingFileSystem(FileSystem):
    """Hashes every file DCP writes below ``root`` as it writes it, into ``digests``."""

    def __init__(self, root: Path, digests: dict[str, FileDigest]) -> None:
        super().__init__()
        self._root = root
        self._digests = digests

    @contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = self._name(path)

        def record(digest: FileDigest) -> None:
            self._digests[name] = digest

        # DCP fsyncs each of its files once written (sync_files): its disk write starts early.
        with HashingStream(Path(path).open("wb"), on_close=record, write_behind=True) as stream:
            yield cast(io.IOBase, stream)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        # DCP writes its metadata under a temporary name first.
        super().rename(path, new_path)
        digest = self._digests.pop(self._name(path), None)
        if digest is not None:
            self._digests[self._name(new_path)] = digest

    def _name(self, path: str | os.PathLike[str]) -> str:
        return Path(path).relative_to(self._root).as_posix()


def hashing_writer(
    path: Path, *, reuse: FileSystemWriter | None = None
) -> tuple[FileSystemWriter, dict[str, FileDigest]]:
    """A DCP writer into ``path``, and the digests (by name below ``path``) of what it wrote.

    The digests fill in as the files close; read them once the save has finished. ``reuse``
    points a writer of :func:`staging_writer` (and its staging buffers) at ``path``.
    """
    digests: dict[str, FileDigest] = {}
    writer = FileSystemWriter(path) if reuse is None else reuse
    writer.fs = _HashingFileSystem(Path(path), digests)
    writer.path = Path(path)
    return writer, digests


def staging_writer() -> FileSystemWriter:
    """A writer for asynchronous saves that stages into the same CPU buffers every time.

    Copying into buffers already faulted in is several times faster than into fresh memory
    (0.08 s against 0.5 s for 600 MB here), and staging is what an asynchronous save blocks on.
    The buffers stay allocated: one CPU copy of what this rank writes, for as long as the writer
    lives. Set ``own_entries`` (see :func:`own_entries`) before each save to stage only those.
    On the public path, DCP's own writer, which stages into fresh CPU memory every time.
    """
    return StagingWriter(".") if fast_io_supported() else FileSystemWriter(".")


def own_entries(state: dict[str, Any], *, rank: int, gather: Gather) -> frozenset[str]:
    """The entries of ``state`` (by flattened name) that DCP's save gives this rank to write.

    DCP writes an entry that several ranks hold (DDP's replicated state) on one of them only. This
    is DCP's own planning, run before the save instead of in it, so that the other ranks need not
    stage that entry. ``gather`` collects an object from every rank (one collective).
    """
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=rank == 0)
    plans, _ = planner.create_global_plan(gather(planner.create_local_plan()))
    return frozenset(item.index.fqn for item in plans[rank].items)


@final
class StagingWriter(FileSystemWriter):
    """Stages into one set of CPU buffers, reused by every save; only the rank's own entries.

    DCP's own ``cache_staged_state_dict`` pins its buffers, which fails without CUDA; these are
    pinned only where CUDA is (not run here: with CUDA, the copy is a device-to-host transfer
    into pinned memory, as DCP does it). The entries another rank writes stay as they are: the
    save reads only their shapes, to plan.
    """

    own_entries: frozenset[str] | None = None
    """The entries this rank writes (flattened names); None for all of them."""
    _buffers: dict[str, Any] | None = None
    _staged: frozenset[str] = frozenset()

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
        from torch.distributed.checkpoint._nested_dict import (
            flatten_state_dict,
            unflatten_state_dict,
        )

        self.per_thread_copy_ahead = 0  # as FileSystemWriter.stage: the data is on the CPU now
        flat, mappings = flatten_state_dict(state_dict)
        own = {name: flat[name] for name in flat if self._owns(name)}
        if self._buffers is None or self._buffers.keys() != own.keys():
            pin = torch.cuda.is_available()
            self._buffers = _create_cpu_state_dict(own, pin_memory=pin)
            if not pin:
                _fault_in(self._buffers.values())
        staged: dict[str, Any] = _copy_state_dict(own, self._buffers)
        self._staged = frozenset(own)
        return unflatten_state_dict({**flat, **staged}, mappings)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        unstaged = sorted({item.index.fqn for item in plan.items} - self._staged)
        if unstaged:
            raise CheckpointError(
                f"The save plan gives this rank entries it did not stage, such as {unstaged[0]}: "
                "the ranks planned the save differently. The checkpoint is not written; this is a "
                "bug, please report it."
            )
        return super().write_data(plan, planner)

    def _owns(self, name: str) -> bool:
        return self.own_entries is None or name in self.own_entries


_MADV_POPULATE_WRITE: Final = 23


def _fault_in(values: Iterable[Any]) -> None:
    """Fault in the pages of fresh CPU tensors in one call each (Linux's MADV_POPULATE_WRITE).

    The first copy into fresh memory otherwise takes a page fault every 4 kB. Here that is most of
    the first asynchronous save: 0.36 s to stage 600 MB, against 0.29 s with the pages faulted in
    first. Where the call is missing (not Linux, Linux before 5.14) the copy faults them in.
    """
    import ctypes

    madvise = libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
    if madvise is None:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    for value in values:
        if isinstance(value, DTensor):
            value = value.to_local()
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            continue
        start = value.data_ptr()
        first = -(-start // page) * page  # whole pages only: the copy faults in the edges
        last = (start + value.numel() * value.element_size()) // page * page
        if last > first and madvise(first, last - first, _MADV_POPULATE_WRITE) != 0:
            return


@final
class _Staged:
    """The stager of ``async_save`` for a state staged already (by :class:`StagingWriter`)."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


STAGED: Final = _Staged()


@final
class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and refuses anything else: no pickle can run code here."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module in _METADATA_MODULES and not name.startswith("__"))
            or (module == "pathlib" and name in _PATH_CLASSES)
            or (module == "torch" and (name == "Size" or _is_dtype(name)))
            or (module == "torch.serialization" and name == "_get_layout")
        )
        if allowed:
            found = super().find_class(module, name)
            if module not in _METADATA_MODULES or getattr(found, "__module__", None) == module:
                return found
        raise pickle.UnpicklingError(
            f"The DCP metadata refers to {module}.{name}, which DCP metadata never holds; "
            "the file is not a checkpoint this project wrote, so it is not loaded."
        )


def _is_dtype(name: str) -> bool:
    return isinstance(getattr(torch, name, None), torch.dtype)


@final
class _HashingReadFileSystem(FileSystem):
    """Opens the files this rank hashes (``mine``, by name below ``root``) as HashingReaders."""

    def __init__(self, root: Path, digests: ReadDigests) -> None:
        super().__init__()
        self._root = root
        self.digests = digests
        self.mine: frozenset[str] = frozenset()

    @contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        name = Path(path).relative_to(self._root).as_posix()
        if mode != "rb" or name not in self.mine:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with HashingReader(Path(path), algorithm=self.digests.algorithm) as reader:
            yield cast(io.IOBase, reader)
            self.digests.hashed[name] = reader.finish()
            self.digests.reread += reader.reread


@final
class _SafeReader(FileSystemReader):
    """Unpickles only DCP's metadata classes. With ``digests`` on the fast path, also reads each
    file's items in offset order, whole tensors in place, and hashes the files assigned to this
    rank as it reads them; otherwise DCP reads as it always does, and nothing is hashed (the
    verification then reads the files for their digests)."""

    def __init__(self, path: Path, digests: ReadDigests | None) -> None:
        super().__init__(path)
        # Why read_metadata refused the file: DCP of torch 2.11 fails the load with a bare
        # "metadata is None" instead, so the load's caller reports this.
        self.metadata_error: Exception | None = None
        self._hashing: _HashingReadFileSystem | None = None
        if digests is not None and fast_io_supported():
            self._hashing = _HashingReadFileSystem(Path(path), digests)
            self.fs = self._hashing

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            return self._read_metadata()
        except Exception as ex:
            self.metadata_error = ex
            raise

    def _read_metadata(self) -> Metadata:
        # The one metadata file of a DCP directory (per-rank metadata is not written here).
        path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = _MetadataUnpickler(metadata_file).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} does not hold DCP metadata.")
        # The rest as FileSystemReader.read_metadata does it.
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """On the coordinator: which files each rank hashes, sent in its plan's storage_data."""
        if self._hashing is None:
            return plans
        reads: list[dict[str, int]] = []
        for plan in plans:
            rank_reads: dict[str, int] = {}
            for index in {item.storage_index for item in plan.items}:
                info = self.storage_data[index]
                rank_reads[info.relative_path] = rank_reads.get(info.relative_path, 0) + info.length
            reads.append(rank_reads)
        assigned = assign_hashing(reads)
        covered = frozenset(name for names in assigned for name in names)
        return [
            dataclasses.replace(plan, storage_data=(frozenset(names), covered))
            for plan, names in zip(plans, assigned, strict=True)
        ]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's reads, each file's in offset order and whole tensors in place (see
        :mod:`checkpoint.dcp_io`)."""
        if self._hashing is None:
            return super().read_data(plan, planner)
        self._hashing.mine, self._hashing.digests.covered = plan.storage_data
        # In offset order, a file is read front to back: hashing it then needs no second read.
        items = sorted(plan.items, key=self._location)

        per_file: dict[str, list[ReadItem]] = {}
        for item in items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for relative_path, file_items in per_file.items():
            path = self.fs.concat_path(self.path, relative_path)
            with self.fs.create_stream(path, "rb") as stream:
                read_items(
                    stream,
                    file_items,
                    storage_data=self.storage_data,
                    transforms=self.transforms,
                    planner=planner,
                )
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _location(self, item: ReadItem) -> tuple[str, int]:
        info = self.storage_data[item.storage_index]
        return (info.relative_path, info.offset)


@final
class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, whose non-tensor entries load with ``weights_only=True``.

    DCP's own loads them (an optimizer's ``param_groups``) with ``torch.load(weights_only=False)``,
    which runs whatever a forged file's pickle says; with ``weights_only``, a forged entry is a
    load error, and so damage.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_bytes_weights_only(self, read_item, value)


def _load_bytes_weights_only(
    planner: DefaultLoadPlanner, read_item: ReadItem, value: io.BytesIO
) -> None:
    """``DefaultLoadPlanner.load_bytes``, with ``weights_only=True``.

    Loads into a state dict that holds the entry already (as a load into a live model does)."""
    loaded = torch.load(value, weights_only=True)
    if not planner.flatten_state_dict:
        planner.state_dict[read_item.dest_index.fqn] = loaded
        return
    *parents, last = planner.mappings[read_item.dest_index.fqn]
    container: Any = planner.original_state_dict
    for key in parents:
        container = container[key]
    container[last] = loaded


def safe_reader(path: Path, digests: ReadDigests | None = None) -> _SafeReader:
    """A DCP reader of ``path`` whose metadata unpickles only DCP's own classes.

    DCP itself reads ``.metadata`` with plain ``pickle.load``; its tensors it reads with
    ``torch.load(weights_only=True)``. With ``digests``, the ranks split the files DCP reads
    between them, and each hashes its files as DCP reads them (see :class:`HashingReader`):
    ``digests`` gets them once the load has finished.
    """
    return _SafeReader(path, digests)


def load_whole(path: Path) -> dict[str, Any]:
    """Every entry of the DCP checkpoint in ``path``, in one process, as a plain state dict.

    ``dcp_to_torch_save`` without its plain ``pickle.load`` of the metadata, and with its
    non-tensor entries loaded ``weights_only`` (see :class:`SafeLoadPlanner`).
    """
    if not fast_io_supported():
        return _load_whole_public(path)
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class WholeLoadPlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            _load_bytes_weights_only(self, read_item, value)

    state: dict[str, Any] = {}
    _load_state_dict(
        state,
        storage_reader=safe_reader(path),
        planner=WholeLoadPlanner(),  # type: ignore[no-untyped-call]
        no_dist=True,
    )
    return state


def _load_whole_public(path: Path) -> dict[str, Any]:
    """:func:`load_whole` through DCP's public ``load``: into a flat state dict made from the
    metadata, nested afterwards as the save's planner recorded it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load

    reader = safe_reader(path)
    metadata = reader.read_metadata()
    flat: dict[str, Any] = {}
    for name, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            flat[name] = torch.empty(entry.size, dtype=entry.properties.dtype)
        else:
            flat[name] = None  # replaced by the entry's object
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load(flat, storage_reader=safe_reader(path), planner=SafeLoadPlanner(), no_dist=True)
    mappings: dict[str, Any] = metadata.planner_data or {}
    state: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, last = mappings.get(name, (name,))
        container = state
        for key in parents:
            container = container.setdefault(key, {})
        container[last] = value
    return state


_BYTE_ORDER = sys.byteorder.encode()
"""What torch.save records as the ``byteorder`` of the tensors it writes on this machine."""


def read_items(
    stream: io.IOBase,
    items: Sequence[ReadItem],
    *,
    storage_data: Mapping[MetadataIndex, _StorageInfo],
    transforms: _StorageReaderTransforms,
    planner: LoadPlanner,
) -> None:
    """Load ``items``, all stored in the file open as ``stream``, into ``planner``'s state."""
    # DCP internals: imported here, on the fast path only (see fast_io_supported).
    from torch.distributed.checkpoint.utils import _create_file_view

    for item in items:
        info = storage_data[item.storage_index]
        view = cast(IO[bytes], _create_file_view(stream, info.offset, info.length))
        if item.type == LoadItemType.TENSOR and not info.transform_descriptors:
            target = planner.resolve_tensor(item).detach()
            if _read_in_place(view, item, target):
                planner.commit_tensor(item, target)
                continue
            view.seek(0)
        _read_as_dcp(view, item, info, transforms, planner)


def _read_in_place(view: IO[bytes], item: ReadItem, target: torch.Tensor) -> bool:
    """Read the entry in ``view`` into ``target`` if it is ``target``'s whole; False if not."""
    if not private_api_present("PyTorchFileReader.get_record_size"):
        return False  # an older torch: the entry loads as DCP loads it
    if target.device.type != "cpu" or not target.is_contiguous() or any(item.storage_offsets):
        return False
    saved = torch.load(view, map_location="meta", weights_only=True)
    whole = (
        type(saved) is torch.Tensor
        and saved.dtype == target.dtype
        and saved.shape == target.shape
        and saved.is_contiguous()
        and saved.storage_offset() == 0
        and saved.untyped_storage().nbytes() == target.nbytes
    )
    if not whole:
        return False
    view.seek(0)
    # Any: torch's stubs lack get_record_offset, which torch.load(mmap=True) uses.
    archive: Any = torch._C.PyTorchFileReader(view)
    names = archive.get_all_records()
    records = [name for name in names if name.startswith("data/")]
    native = "byteorder" in names and bytes(archive.get_record("byteorder")) == _BYTE_ORDER
    if len(records) != 1 or not native or archive.get_record_size(records[0]) != target.nbytes:
        return False
    view.seek(archive.get_record_offset(records[0]))
    _read_exactly(view, target, item)
    # As copy_ would: autograd then refuses a backward through what the read overwrote.
    increment_version(target)
    return True


def _read_exactly(view: IO[bytes], target: torch.Tensor, item: ReadItem) -> None:
    if target.nbytes == 0:
        return  # an empty tensor may have no address
    # The tensor's own bytes, writable (through ctypes: numpy is not a dependency).
    buffer = memoryview((ctypes.c_char * target.nbytes).from_address(target.data_ptr())).cast("B")
    reader = cast(io.RawIOBase, view)
    done = 0
    while done < len(buffer):
        count = reader.readinto(buffer[done:])
        if not count:
            raise CheckpointError(
                f"The file of {item.storage_index.fqn} ends {len(buffer) - done} bytes before "
                "the tensor does: it is truncated."
            )
        done += count


def _read_as_dcp(
    view: IO[bytes],
    item: ReadItem,
    info: _StorageInfo,
    transforms: _StorageReaderTransforms,
    planner: LoadPlanner,
) -> None:
    """One entry as ``FileSystemReader.read_data`` of torch 2.13 reads it."""
    from torch.distributed._shard._utils import narrow_tensor_by_index

    stream: Any = transforms.transform_load_stream(item, info.transform_descriptors or (), view)
    if item.type == LoadItemType.BYTE_IO:
        planner.load_bytes(item, io.BytesIO(stream.read(-1)))
        return
    seekable = stream if stream.seekable() else io.BytesIO(stream.read(-1))
    tensor = torch.load(seekable, map_location="cpu", weights_only=True)
    tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise CheckpointError(
            f"The entry {item.storage_index.fqn} has the size {tuple(tensor.size())} in its "
            f"file, but {tuple(target.size())} in the checkpoint's metadata: the file is damaged."
        )
    target.copy_(tensor)
    planner.commit_tensor(item, target)
