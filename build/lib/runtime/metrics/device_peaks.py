"""The dense peak FLOP/s of common CUDA devices in each precision their matmuls run in, for
model FLOPs utilization (``mfu``).

``mfu`` compares the FLOPs a run needs with what the device could do in the precision the
model computes in: float32 without TF32 runs on the CUDA cores, TF32 and bfloat16/float16 on the
tensor cores, at peaks about 7 and 15 times higher on an H100. Dividing a float32 run by the
bf16 peak would report a tenth of its real utilization.
"""

from __future__ import annotations

import re
from typing import Literal

import torch
from torch.nn import Module

from runtime.parallel.wrapping import fsdp_param_dtype

MatmulPrecision = Literal["fp32", "tf32", "bf16"]
"""What a matmul runs in: plain float32, float32 inputs on TF32 tensor cores, or 16-bit floats
(bfloat16 and float16 share their peak)."""

# Dense (not sparse) peaks from the data sheets: (model, variant or None, (fp32, tf32, bf16)). A
# device matches an entry when its CUDA name holds the model (and the variant) as whole words,
# so "L4" is not an "L40"; the first match wins, so a variant comes before its family.
PEAK_FLOPS: tuple[tuple[str, str | None, tuple[float, float, float]], ...] = (
    ("H100", "PCIe", (51e12, 378e12, 756e12)),
    ("H100", "NVL", (60e12, 418e12, 835e12)),
    ("H100", None, (67e12, 495e12, 989e12)),
    ("H200", "NVL", (60e12, 418e12, 835e12)),
    ("H200", None, (67e12, 495e12, 989e12)),
    ("H800", "PCIe", (51e12, 378e12, 756e12)),
    ("H800", None, (67e12, 495e12, 989e12)),
    ("A100", None, (19.5e12, 156e12, 312e12)),
    ("A800", None, (19.5e12, 156e12, 312e12)),
    ("L40S", None, (91.6e12, 183e12, 362e12)),
    ("L40", None, (90.5e12, 90.5e12, 181e12)),
    ("L4", None, (30.3e12, 60e12, 121e12)),
)

_COLUMNS: dict[MatmulPrecision, int] = {"fp32": 0, "tf32": 1, "bf16": 2}


def peak_flops(device_name: str, precision: MatmulPrecision) -> float | None:
    """The dense peak FLOP/s in ``precision`` of the device CUDA names ``device_name`` (e.g.
    ``NVIDIA H100 80GB HBM3``); None if it is not in :data:`PEAK_FLOPS`."""
    words = {word.upper() for word in re.split(r"[\s_-]+", device_name)}
    for model, variant, peaks in PEAK_FLOPS:
        if model.upper() in words and (variant is None or variant.upper() in words):
            return peaks[_COLUMNS[precision]]
    return None


def matmul_precision(compute_dtype: torch.dtype) -> MatmulPrecision:
    """What the matmuls of a model computing in ``compute_dtype`` run in: 16-bit floats on the
    tensor cores, float32 there too (TF32) when torch's float32 matmul precision allows it
    (``torch.set_float32_matmul_precision("high")``), float32 on the CUDA cores otherwise."""
    if compute_dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    if compute_dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "fp32"


def compute_dtype(model: Module, *, autocast_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``model``'s matmuls compute in: autocast's (``autocast_dtype``, None when off),
    else the ``param_dtype`` FSDP2 gathers the parameters in, else the parameters' own (float32
    when they mix dtypes)."""
    if autocast_dtype is not None:
        return autocast_dtype
    gathered = fsdp_param_dtype(model)
    if gathered is not None:
        return gathered
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32
