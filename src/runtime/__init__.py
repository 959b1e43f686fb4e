"""The training runtime: the Trainer and everything around its loop.

Names are imported from their modules when first used (``from runtime import Trainer`` loads
the Trainer's modules only), so that ``import runtime``, ``--help`` and a config error stay fast.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # The exported names, each once, from its module (``X as X`` marks a re-export for type
    # checkers). They are read here only by type checkers and by _exports below: at run time
    # a module is imported on the first use of one of its names.
    from runtime.cli.config import ConfigError as ConfigError
    from runtime.cli.recipe_main import main as main
    from runtime.data import DataReader as DataReader
    from runtime.data import DataReaderError as DataReaderError
    from runtime.data import IterableDataReader as IterableDataReader
    from runtime.data import MapDataReader as MapDataReader
    from runtime.data import SyncMode as SyncMode
    from runtime.data import WindowedDataReader as WindowedDataReader
    from runtime.errors import NonFiniteError as NonFiniteError
    from runtime.errors import TrainerError as TrainerError
    from runtime.metrics.profiler import TorchProfiler as TorchProfiler
    from runtime.metrics.progress import ProgressDisplay as ProgressDisplay
    from runtime.metrics.progress import make_progress_display as make_progress_display
    from runtime.metrics.recorders import CompositeMetricRecorder as CompositeMetricRecorder
    from runtime.metrics.recorders import CsvMetricRecorder as CsvMetricRecorder
    from runtime.metrics.recorders import JsonlMetricRecorder as JsonlMetricRecorder
    from runtime.metrics.recorders import LogMetricRecorder as LogMetricRecorder
    from runtime.metrics.recorders import MetricRecorder as MetricRecorder
    from runtime.metrics.recorders import TensorBoardRecorder as TensorBoardRecorder
    from runtime.metrics.recorders import WandbRecorder as WandbRecorder
    from runtime.parallel.activation_recompute import (
        apply_activation_checkpointing as apply_activation_checkpointing,
    )
    from runtime.parallel.compile import compile_blocks as compile_blocks
    from runtime.parallel.compile import compile_loss as compile_loss
    from runtime.parallel.materialize import has_meta_tensors as has_meta_tensors
    from runtime.parallel.materialize import materialize_model as materialize_model
    from runtime.parallel.parallelize import parallelize_model as parallelize_model
    from runtime.parallel.wrapping import DataParallelKind as DataParallelKind
    from runtime.parallel.wrapping import apply_data_parallel as apply_data_parallel
    from runtime.parallel.wrapping import apply_tensor_parallel as apply_tensor_parallel
    from runtime.training.early_stop import EarlyStopper as EarlyStopper
    from runtime.training.early_stop import PatienceEarlyStopper as PatienceEarlyStopper
    from runtime.training.evaluation import Evaluator as Evaluator
    from runtime.training.evaluation import combine_scores as combine_scores
    from runtime.training.evaluation import evaluate_units as evaluate_units
    from runtime.training.gradients import clip_gradient_norm as clip_gradient_norm
    from runtime.training.initial_weights import InitialWeights as InitialWeights
    from runtime.training.initial_weights import InitialWeightsError as InitialWeightsError
    from runtime.training.initial_weights import InitSource as InitSource
    from runtime.training.initial_weights import load_initial_weights as load_initial_weights
    from runtime.training.loss_scale import LossScaler as LossScaler
    from runtime.training.loss_spike import LossSpikeError as LossSpikeError
    from runtime.training.loss_spike import LossSpikeGuard as LossSpikeGuard
    from runtime.training.out_of_memory import StepOutOfMemoryError as StepOutOfMemoryError
    from runtime.training.schedule import Schedule as Schedule
    from runtime.training.signals import PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE
    from runtime.training.state import StopReason as StopReason
    from runtime.training.state import TrainState as TrainState
    from runtime.training.trainer import Trainer as Trainer
    from runtime.training.weight_reload import ReloadInitialWeights as ReloadInitialWeights
    from trainkit_utils.modules import InitFn as InitFn
    from trainkit_utils.modules import unwrap_model as unwrap_model
    from units.callback import TrainerCallback as TrainerCallback


@functools.cache
def _exports() -> dict[str, str]:
    """The module of each exported name, as the imports under ``TYPE_CHECKING`` above say."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    (block,) = (
        node
        for node in tree.body
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
    )
    return {
        alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names
    }


def __getattr__(name: str) -> Any:
    if name == "__all__":
        value: Any = list(_exports())
    else:
        module = _exports().get(name)
        if module is None:
            raise AttributeError(f"module 'runtime' has no attribute '{name}'")
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(_exports())
