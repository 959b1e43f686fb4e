"""DCP's reads of one file, with each whole tensor read straight into the tensor it loads into.

DCP's ``FileSystemReader`` loads a tensor entry with ``torch.load`` into a fresh tensor and copies
that into the state dict's: every byte is copied twice, the first time into memory the kernel
must fault in page by page. Here an entry saved whole (a contiguous tensor, as DCP saves them) and
loaded whole into a contiguous CPU tensor of its dtype and shape is read from the file into that
tensor directly: ``torch.load(map_location="meta", weights_only=True)`` reads only the entry's
header to say what it holds, and the zip directory says where its bytes are. Every other entry
(a slice, a resharded or cast one, bytes) loads as DCP loads it.

Nothing is trusted more than before: the header is read ``weights_only``, the bytes land only in a
tensor whose size they must fill exactly, and the file's digest is checked after the load as it
always is (see :mod:`checkpoint.verification`).
"""

from __future__ import annotations

import ctypes
import io
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any, cast

import torch
from torch.autograd.graph import increment_version
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StorageReaderTransforms
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem
from torch.distributed.checkpoint.utils import _create_file_view

from checkpoint.errors import CheckpointError

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
