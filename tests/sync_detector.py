"""A test-only detector of host-device synchronizations: the operations that make the host wait
for the device to read a value (``item``, ``tolist``, ``bool``/``float``/``int`` of a tensor,
``nonzero``, ``torch.equal``, ``.cpu()``, ``.numpy()``, data-dependent shapes such as
``masked_select``), at the Python level and in the dispatcher. Inside a tensor subclass's own
ops (DTensor's, on its local tensors) only the dispatcher's view is left: ``item``, ``bool`` and
the data-dependent ops are seen there, a ``tolist`` or ``numpy`` (which read without an op) not.

On CPU no operation really waits, so every tensor counts as a device tensor, but for those made
under watch of Python numbers by a factory told ``device="cpu"``: code that keeps numbers on the
host on purpose (the step's totals, summed over the ranks by gloo) says so, and reading them
never waits for a GPU. Enable the detector only around the work under test (the steady steps),
not around the reader's index arithmetic.

:class:`SyncWindow` watches a Trainer's steady steps, and :data:`FEATURES` names the Trainer
options the host-sync tests run, in one process and under torchrun alike.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from gangs import Gangs
from runtime import LossSpikeGuard, TorchProfiler, TrainerCallback
from tests.conftest import make_toy_trainer

_PYTHON_SYNCS: set[Callable[..., Any]] = {
    Tensor.item,
    Tensor.tolist,
    Tensor.numpy,
    Tensor.cpu,
    Tensor.__bool__,
    Tensor.__float__,
    Tensor.__int__,
    Tensor.__index__,
    Tensor.nonzero,
    Tensor.masked_select,
    Tensor.unique,
    torch.nonzero,
    torch.equal,
    torch.masked_select,
    torch.unique,
    torch.is_nonzero,
}

_DISPATCH_SYNCS = {
    "aten._local_scalar_dense.default",
    "aten.item.default",
    "aten.nonzero.default",
    "aten.equal.default",
    "aten.masked_select.default",
    "aten.is_nonzero.default",
    "aten._unique2.default",
}


_FACTORIES: set[Callable[..., Any]] = {
    torch.tensor,
    torch.as_tensor,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
}


_PLAIN = (Tensor, torch.nn.Parameter)


class _Found:
    """The syncs found; ``inside`` while a Python-level sync runs, so that the dispatcher's view
    of the same operation does not count it twice; the tensors made on the host on purpose."""

    def __init__(self, syncs: list[str]) -> None:
        self.syncs = syncs
        self.inside = False
        self.host_tensors: WeakIdKeyDictionary = WeakIdKeyDictionary()


class _FunctionSyncs(TorchFunctionMode):
    def __init__(self, found: _Found) -> None:
        super().__init__()
        self._found = found

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if (
            func in _FACTORIES
            and _is_host(kwargs.get("device"))
            and not any(isinstance(arg, Tensor) for arg in args)
        ):
            made = func(*args, **kwargs)
            self._found.host_tensors[made] = True
            return made
        if not (func in _PYTHON_SYNCS or (func is Tensor.to and _to_host(args, kwargs))):
            return func(*args, **kwargs)
        on_host = bool(args) and isinstance(args[0], Tensor) and args[0] in self._found.host_tensors
        if not on_host and not self._found.inside:
            self._found.syncs.append(f"{getattr(func, '__name__', func)} at {_caller()}")
        inside, self._found.inside = self._found.inside, True
        try:
            return func(*args, **kwargs)
        finally:
            self._found.inside = inside


class _DispatchSyncs(TorchDispatchMode):
    def __init__(self, found: _Found) -> None:
        super().__init__()
        self._found = found

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if any(kind not in _PLAIN for kind in types):
            # A tensor subclass (DTensor) runs the op itself, with this mode still on: what its
            # Python does on the local tensors (sharding propagation included) is watched too.
            return NotImplemented
        if str(func) in _DISPATCH_SYNCS and not self._found.inside:
            self._found.syncs.append(f"{func} at {_caller()}")
        return func(*args, **(kwargs or {}))


class HostSyncDetector:
    """``with HostSyncDetector() as detector: ...``; then ``detector.syncs`` lists each
    operation that would make the host wait, with the line that caused it. ``enter()`` and
    ``exit()`` do the same across callbacks."""

    def __init__(self) -> None:
        self.syncs: list[str] = []
        self._modes: list[Any] = []

    def enter(self) -> None:
        found = _Found(self.syncs)
        self._modes = [_FunctionSyncs(found), _DispatchSyncs(found)]
        for mode in self._modes:
            mode.__enter__()

    def exit(self) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)
        self._modes = []

    def __enter__(self) -> HostSyncDetector:
        self.enter()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.exit()


FIRST, LAST = 3, 7
"""A :class:`SyncWindow` watches from the end of step FIRST to the end of step LAST: steps 4 to 7
and the loop's work between them. A run under watch publishes its metrics first at step 100, and
its data epoch outlasts the window (a reader checks once an epoch that the ranks agree)."""

WATCHED_STEPS = LAST - FIRST

FEATURES: dict[str, dict[str, Any]] = {
    "plain": {},
    "accumulation": {"num_accumulate": 2},
    "clipping": {"max_gradient_norm": 0.5},
    "nan_policy_error": {"nan_policy": "error"},
    "profiler": {"profiler": True},
    "nan_policy_skip": {"nan_policy": "skip"},
    "fp16": {"dtype": torch.float16, "amp": True},
    "loss_spike_guard": {
        "loss_spike_guard": LossSpikeGuard(),
        "checkpoint_every_n_steps": 100,
    },
    "loss_spike_every_step": {
        "loss_spike_guard": LossSpikeGuard(check_every_step=True),
        "checkpoint_every_n_steps": 100,
    },
}
"""The Trainer options under watch (``profiler``: a TorchProfiler of the run's root gang)."""

SYNCS_PER_STEP: dict[str, dict[str, int]] = {
    "nan_policy_skip": {"step_totals.py": 1, "non_finite.py": 1},
    "fp16": {"loss_scale.py": 1},
    "loss_spike_every_step": {"non_finite.py": 1},
}
"""The features that decide on the host whether a step's update is applied, and the syncs a step
pays for it, by the file that reads: ``nan_policy="skip"`` reads whether this rank's losses were
finite, then the gradient norm; fp16 loss scaling reads the gradient norm; the loss-spike guard's
``check_every_step`` reads the step's losses. Every other feature pays none."""


def assert_as_pinned(feature: str, syncs: list[str]) -> None:
    """``syncs``, found by a :class:`SyncWindow`, are none, or for a feature of
    :data:`SYNCS_PER_STEP` its reads: each file's, once a watched step. By file, so that a new
    sync cannot stand in for a removed one unnoticed."""
    per_step = SYNCS_PER_STEP.get(feature, {})
    found = {name: sum(f"/{name}:" in sync for sync in syncs) for name in per_step}
    expected = {name: count * WATCHED_STEPS for name, count in per_step.items()}
    assert found == expected and len(syncs) == sum(expected.values()), syncs


class SyncWindow(TrainerCallback):
    """Runs a :class:`HostSyncDetector` from the end of step FIRST to the end of step LAST.

    With ``cuda``, CUDA's own sync check runs in the same window
    (``torch.cuda.set_sync_debug_mode``): it sees the syncs the device really makes, which the
    detector, run on the CPU, can only infer; :attr:`cuda_syncs` has its warnings.
    """

    def __init__(self, *, cuda: bool = False) -> None:
        self.detector = HostSyncDetector()
        self.cuda_syncs: list[str] = []
        self._cuda_check = warnings.catch_warnings(record=True) if cuda else None
        self._cuda_warnings: list[warnings.WarningMessage] | None = None

    def on_step_end(self, *, step_nr: int, **_: Any) -> None:
        if step_nr == FIRST:
            self.detector.enter()
            if self._cuda_check is not None:
                self._cuda_warnings = self._cuda_check.__enter__()
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
        elif step_nr == LAST:
            if self._cuda_check is not None:
                torch.cuda.set_sync_debug_mode(0)
                self._cuda_check.__exit__(None, None, None)
                self.cuda_syncs = [
                    str(w.message)
                    for w in self._cuda_warnings or []
                    if "synchronizing" in str(w.message)
                ]
            self.detector.exit()


def watched_syncs(
    tmp_path: Path, feature: str, *, device: torch.device | None = None
) -> SyncWindow:
    """The window of a one-process toy run with ``feature``, on ``device`` (the CPU by default)."""
    options = dict(FEATURES[feature])
    if options.pop("profiler", False):
        options["profiler"] = TorchProfiler(1, 2, tmp_path / "profile", Gangs.single().root)
    window = SyncWindow(cuda=device is not None and device.type == "cuda")
    trainer = make_toy_trainer(
        tmp_path,
        max_num_steps=10,
        publish_metrics_every_n_steps=100,
        callbacks=[window],
        dataset_size=256,
        device=device,
        **options,
    )
    try:
        trainer.run()
    finally:
        trainer.close()
    return window


def _is_host(device: object) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu"


def _to_host(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """``tensor.to("cpu")`` of a tensor that is not on the CPU."""
    source = args[0] if args else None
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(source, Tensor) and source.device.type != "cpu" and _is_host(target)


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-1]):
        if "sync_detector" not in frame.filename and "/torch/" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} ({frame.line})"
    return "?"
