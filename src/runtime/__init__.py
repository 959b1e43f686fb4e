"""The training runtime: the Trainer and everything around its loop."""

from __future__ import annotations

from runtime.activation_checkpoint import apply_activation_checkpointing
from runtime.callbacks import TrainerCallback
from runtime.cli import main
from runtime.compile import compile_blocks, compile_loss
from runtime.config import ConfigError
from runtime.data import DataReader, DataReaderError, IterableDataReader, MapDataReader, SyncMode
from runtime.early_stop import EarlyStopper, PatienceEarlyStopper
from runtime.errors import TrainerError
from runtime.evaluator import Evaluator, combine_scores, evaluate_units
from runtime.gradients import clip_gradient_norm
from runtime.init_weights import InitialWeights, InitialWeightsError, load_initial_weights
from runtime.loss_scale import LossScaler
from runtime.model_init import InitFn, has_meta_tensors, materialize_model
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
    "InitFn",
    "InitialWeights",
    "InitialWeightsError",
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
    "apply_activation_checkpointing",
    "apply_data_parallel",
    "apply_tensor_parallel",
    "clip_gradient_norm",
    "combine_scores",
    "compile_blocks",
    "compile_loss",
    "evaluate_units",
    "has_meta_tensors",
    "load_initial_weights",
    "main",
    "make_progress_display",
    "materialize_model",
    "unwrap_model",
]
