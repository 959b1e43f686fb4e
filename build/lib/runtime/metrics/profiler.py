"""A torch.profiler window over a few training steps, written for TensorBoard."""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import final

from gangs import Gang
from trainkit_utils.arguments import check_not_negative, check_positive


@final
class TorchProfiler:
    """Skips ``num_skip_steps`` steps, warms up one, then records ``num_record_steps``.

    Each rank writes its trace to ``profile_dir/rank_N``; open it with TensorBoard's profiler
    plugin or ``chrome://tracing``.
    """

    def __init__(
        self, num_skip_steps: int, num_record_steps: int, profile_dir: Path, gang: Gang
    ) -> None:
        check_not_negative("num_skip_steps", num_skip_steps)
        check_positive("num_record_steps", num_record_steps)
        # Imported here: torch.profiler takes a tenth of a second to import.
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        self._profile_dir = Path(profile_dir)
        activities = [ProfilerActivity.CPU]
        if gang.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(
            activities=activities,
            schedule=schedule(wait=num_skip_steps, warmup=1, active=num_record_steps, repeat=1),
            on_trace_ready=tensorboard_trace_handler(str(self._profile_dir / f"rank_{gang.rank}")),
            record_shapes=True,
        )

    @property
    def profile_dir(self) -> Path:
        return self._profile_dir

    def __enter__(self) -> TorchProfiler:
        self._profile.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._profile.__exit__(exc_type, exc, tb)  # type: ignore[no-untyped-call]

    def step(self) -> None:
        self._profile.step()
