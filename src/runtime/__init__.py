"""The training runtime: the Trainer and everything around its loop.

Names are imported from their modules when first used (``from runtime import Trainer`` loads
the Trainer's modules only), so that ``import runtime``, ``--help`` and a config error stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.activation_checkpoint import apply_activation_checkpointing
    from runtime.callbacks import TrainerCallback
    from runtime.cli import main
    from runtime.compile import compile_blocks, compile_loss
    from runtime.config import ConfigError
    from runtime.data import (
        DataReader,
        DataReaderError,
        IterableDataReader,
        MapDataReader,
        SyncMode,
    )
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
        CsvMetricRecorder,
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

_MODULE_OF: dict[str, str] = {
    "CompositeMetricRecorder": "runtime.recorders",
    "ConfigError": "runtime.config",
    "CsvMetricRecorder": "runtime.recorders",
    "DataParallelKind": "runtime.parallel",
    "DataReader": "runtime.data",
    "DataReaderError": "runtime.data",
    "EarlyStopper": "runtime.early_stop",
    "Evaluator": "runtime.evaluator",
    "InitFn": "runtime.model_init",
    "InitialWeights": "runtime.init_weights",
    "InitialWeightsError": "runtime.init_weights",
    "IterableDataReader": "runtime.data",
    "JsonlMetricRecorder": "runtime.recorders",
    "LogMetricRecorder": "runtime.recorders",
    "LossScaler": "runtime.loss_scale",
    "MapDataReader": "runtime.data",
    "MetricRecorder": "runtime.recorders",
    "PREEMPTED_EXIT_CODE": "runtime.signals",
    "PatienceEarlyStopper": "runtime.early_stop",
    "ProgressDisplay": "runtime.progress",
    "Schedule": "runtime.schedule",
    "StopReason": "runtime.train_state",
    "SyncMode": "runtime.data",
    "TensorBoardRecorder": "runtime.recorders",
    "TorchProfiler": "runtime.profiler",
    "TrainState": "runtime.train_state",
    "Trainer": "runtime.trainer",
    "TrainerCallback": "runtime.callbacks",
    "TrainerError": "runtime.errors",
    "WandbRecorder": "runtime.recorders",
    "apply_activation_checkpointing": "runtime.activation_checkpoint",
    "apply_data_parallel": "runtime.parallel",
    "apply_tensor_parallel": "runtime.parallel",
    "clip_gradient_norm": "runtime.gradients",
    "combine_scores": "runtime.evaluator",
    "compile_blocks": "runtime.compile",
    "compile_loss": "runtime.compile",
    "evaluate_units": "runtime.evaluator",
    "has_meta_tensors": "runtime.model_init",
    "load_initial_weights": "runtime.init_weights",
    "main": "runtime.cli",
    "make_progress_display": "runtime.progress",
    "materialize_model": "runtime.model_init",
    "unwrap_model": "runtime.parallel",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "PREEMPTED_EXIT_CODE",
    "CompositeMetricRecorder",
    "ConfigError",
    "CsvMetricRecorder",
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
