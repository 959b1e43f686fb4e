"""What users subclass: train and eval units, and the metric bag they record into."""

from __future__ import annotations

from units.metric_bag import MetricBag
from units.unit import EvalUnit, TrainUnit

__all__ = ["EvalUnit", "MetricBag", "TrainUnit"]
