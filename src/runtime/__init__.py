"""The training runtime: the Trainer and everything around its loop.

Names are imported from their modules when first used (``from runtime import Trainer`` loads
the Trainer's modules only), so that ``import runtime``, ``--help`` and a config error stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.cli.config import ConfigError
    from runtime.cli.recipe_main import main
    from runtime.data import (
        DataReader,
        DataReaderError,
        IterableDataReader,
        MapDataReader,
        SyncMode,
        WindowedDataReader,
    )
    from runtime.errors import NonFiniteError, TrainerError
    from runtime.metrics.profiler import TorchProfiler
    from runtime.metrics.progress import ProgressDisplay, make_progress_display
    from runtime.metrics.recorders import (
        CompositeMetricRecorder,
        CsvMetricRecorder,
        JsonlMetricRecorder,
        LogMetricRecorder,
        MetricRecorder,
        TensorBoardRecorder,
        WandbRecorder,
    )
    from runtime.parallel.activation_recompute import apply_activation_checkpointing
    from runtime.parallel.compile import compile_blocks, compile_loss
    from runtime.parallel.materialize import InitFn, has_meta_tensors, materialize_model
    from runtime.parallel.parallelize import parallelize_model
    from runtime.parallel.wrapping import (
        DataParallelKind,
        apply_data_parallel,
        apply_tensor_parallel,
        unwrap_model,
    )
    from runtime.training.callbacks import TrainerCallback
    from runtime.training.early_stop import EarlyStopper, PatienceEarlyStopper
    from runtime.training.evaluation import Evaluator, combine_scores, evaluate_units
    from runtime.training.gradients import clip_gradient_norm
    from runtime.training.initial_weights import (
        InitialWeights,
        InitialWeightsError,
        InitSource,
        load_initial_weights,
    )
    from runtime.training.loss_scale import LossScaler
    from runtime.training.loss_spike import LossSpikeError, LossSpikeGuard
    from runtime.training.out_of_memory import StepOutOfMemoryError
    from runtime.training.schedule import Schedule
    from runtime.training.signals import PREEMPTED_EXIT_CODE
    from runtime.training.state import StopReason, TrainState
    from runtime.training.trainer import Trainer
    from runtime.training.weight_reload import ReloadInitialWeights

_MODULE_OF: dict[str, str] = {
    "CompositeMetricRecorder": "runtime.metrics.recorders",
    "ConfigError": "runtime.cli.config",
    "CsvMetricRecorder": "runtime.metrics.recorders",
    "DataParallelKind": "runtime.parallel.wrapping",
    "DataReader": "runtime.data",
    "DataReaderError": "runtime.data",
    "EarlyStopper": "runtime.training.early_stop",
    "Evaluator": "runtime.training.evaluation",
    "InitFn": "runtime.parallel.materialize",
    "InitialWeights": "runtime.training.initial_weights",
    "InitSource": "runtime.training.initial_weights",
    "ReloadInitialWeights": "runtime.training.weight_reload",
    "InitialWeightsError": "runtime.training.initial_weights",
    "IterableDataReader": "runtime.data",
    "JsonlMetricRecorder": "runtime.metrics.recorders",
    "LogMetricRecorder": "runtime.metrics.recorders",
    "LossScaler": "runtime.training.loss_scale",
    "MapDataReader": "runtime.data",
    "MetricRecorder": "runtime.metrics.recorders",
    "PREEMPTED_EXIT_CODE": "runtime.training.signals",
    "PatienceEarlyStopper": "runtime.training.early_stop",
    "ProgressDisplay": "runtime.metrics.progress",
    "Schedule": "runtime.training.schedule",
    "StepOutOfMemoryError": "runtime.training.out_of_memory",
    "StopReason": "runtime.training.state",
    "SyncMode": "runtime.data",
    "TensorBoardRecorder": "runtime.metrics.recorders",
    "TorchProfiler": "runtime.metrics.profiler",
    "TrainState": "runtime.training.state",
    "Trainer": "runtime.training.trainer",
    "TrainerCallback": "runtime.training.callbacks",
    "TrainerError": "runtime.errors",
    "NonFiniteError": "runtime.errors",
    "LossSpikeError": "runtime.training.loss_spike",
    "LossSpikeGuard": "runtime.training.loss_spike",
    "WandbRecorder": "runtime.metrics.recorders",
    "WindowedDataReader": "runtime.data",
    "apply_activation_checkpointing": "runtime.parallel.activation_recompute",
    "apply_data_parallel": "runtime.parallel.wrapping",
    "apply_tensor_parallel": "runtime.parallel.wrapping",
    "clip_gradient_norm": "runtime.training.gradients",
    "combine_scores": "runtime.training.evaluation",
    "compile_blocks": "runtime.parallel.compile",
    "compile_loss": "runtime.parallel.compile",
    "evaluate_units": "runtime.training.evaluation",
    "has_meta_tensors": "runtime.parallel.materialize",
    "load_initial_weights": "runtime.training.initial_weights",
    "main": "runtime.cli.recipe_main",
    "make_progress_display": "runtime.metrics.progress",
    "materialize_model": "runtime.parallel.materialize",
    "parallelize_model": "runtime.parallel.parallelize",
    "unwrap_model": "runtime.parallel.wrapping",
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
    "InitSource",
    "InitialWeightsError",
    "IterableDataReader",
    "JsonlMetricRecorder",
    "LogMetricRecorder",
    "LossScaler",
    "MapDataReader",
    "MetricRecorder",
    "PatienceEarlyStopper",
    "ReloadInitialWeights",
    "ProgressDisplay",
    "Schedule",
    "StepOutOfMemoryError",
    "StopReason",
    "SyncMode",
    "TensorBoardRecorder",
    "TorchProfiler",
    "Trainer",
    "TrainerCallback",
    "TrainState",
    "TrainerError",
    "NonFiniteError",
    "LossSpikeError",
    "LossSpikeGuard",
    "WandbRecorder",
    "WindowedDataReader",
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
    "parallelize_model",
    "unwrap_model",
]
