"""The models and data the step-time comparisons train: every loop gets them from here."""

from __future__ import annotations

from benchmarks.workloads.base import StepPlan, Workload
from benchmarks.workloads.registry import WORKLOAD_NAMES, make_workload

__all__ = ["WORKLOAD_NAMES", "StepPlan", "Workload", "make_workload"]
