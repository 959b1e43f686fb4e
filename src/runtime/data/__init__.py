"""Data readers: sharded, resumable streams of micro-batches, one list of them per step."""

from __future__ import annotations

from runtime.data.data_reader import (
    DataReader,
    DataReaderError,
    DataReaderWrapper,
    SyncMode,
    WaitInterrupted,
)
from runtime.data.device import DeviceDataReader, move_to_device, pin_memory
from runtime.data.iterable_reader import IterableDataReader
from runtime.data.map_reader import MapDataReader, MapDataset
from runtime.data.windows import WindowedDataReader, load_window_files

__all__ = [
    "DataReader",
    "DataReaderError",
    "DataReaderWrapper",
    "DeviceDataReader",
    "IterableDataReader",
    "MapDataReader",
    "MapDataset",
    "SyncMode",
    "WaitInterrupted",
    "WindowedDataReader",
    "load_window_files",
    "move_to_device",
    "pin_memory",
]
