"""The training runtime: the Trainer and everything around its loop."""

from __future__ import annotations

from runtime.callbacks import TrainerCallback
from runtime.cli import main
from runtime.config import ConfigError
from runtime.data import DataReader, DataReaderError, IterableDataReader, MapDataReader, SyncMode
from runtime.early_stop import EarlyStopper, PatienceEarlyStopper
from runtime.errors import TrainerError
from runtime.evaluator import Evaluator, combine_scores, evaluate_units
from runtime.gradients import clip_gradient_norm
from runtime.loss_scale import LossScaler
from runtime.parallel import (
    DataParallelKind,
    apply_data_parallel,
    apply_tensor_parallel,
    unwrap_model,
)
from runtime.profiler import TorchProfiler
from runtime.progress import ProgressDisplay, make_progress_display
from runtime.recorders import (
    CompositeMetricRecorder,
    JsonlMetricRecorder,
    LogMetricRecorder,
    MetricRecorder,
    TensorBoardRecorder,
    WandbRecorder,
)
from runtime.schedule import Schedule
from runtime.signals import PREEMPTED_EXIT_CODE
from runtime.train_state import StopReason, TrainState
from runtime.trainer import Trainer

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "CompositeMetricRecorder",
    "ConfigError",
    "DataParallelKind",
    "DataReader",
    "DataReaderError",
    "EarlyStopper",
    "Evaluator",
    "IterableDataReader",
    "JsonlMetricRecorder",
    "LogMetricRecorder",
    "LossScaler",
    "MapDataReader",
    "MetricRecorder",
    "PatienceEarlyStopper",
    "ProgressDisplay",
    "Schedule",
    "StopReason",
    "SyncMode",
    "TensorBoardRecorder",
    "TorchProfiler",
    "Trainer",
    "TrainerCallback",
    "TrainState",
    "TrainerError",
    "WandbRecorder",
    "apply_data_parallel",
    "apply_tensor_parallel",
    "clip_gradient_norm",
    "combine_scores",
    "evaluate_units",
    "main",
    "make_progress_display",
    "unwrap_model",
]
