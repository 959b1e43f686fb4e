"""The random number generators a resume must restore, and how each rank seeds them."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # NumPy is optional: without it there is no generator of its to seed.
    np = None  # type: ignore[assignment]


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if np is not None:
        # As tensors and plain values: a checkpoint loads with weights_only=True.
        numpy_state = np.random.get_state(legacy=True)
        assert isinstance(numpy_state, tuple)
        kind, keys, pos, has_gauss, gauss = numpy_state
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss]
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    python_state = state["python"]
    # weights_only loading gives the inner tuple back as a list.
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    # A checkpoint written before NumPy's generator was saved lacks it.
    if "numpy" in state and np is not None:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_rngs(seed: int, *, dp_rank: int, dp_size: int, step_nr: int = 0) -> None:
    """Seed Python's, NumPy's and torch's generators (CUDA's too) for this rank at ``step_nr``.

    TP ranks of one DP rank must draw the same numbers (e.g. dropout on replicated activations);
    DP ranks see different data and draw different ones. After a reshard, the step keeps the
    numbers apart from those already drawn.
    """
    rank_seed = seed + dp_rank + step_nr * dp_size
    random.seed(rank_seed)
    if np is not None:
        np.random.seed(rank_seed % 2**32)
    torch.manual_seed(rank_seed)
