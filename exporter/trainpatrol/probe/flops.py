"""A model's training FLOPs and its device's peak: achieved FLOP/s and MFU (model FLOPs utilisation).

The model's FLOPs per token (``PatrolConfig.flops_per_token``) or per step (``flops_per_step``, or
``measure_flops`` once before training) times the rank's tokens or steps per second is what it achieves; the
device's dense peak for the dtype the model computes in is what it could. The peaks are NVIDIA's data-sheet
figures without sparsity; a device or dtype the table lacks has no peak, and then no MFU is exported rather than
a wrong one (``PatrolConfig.peak_flops`` overrides the table). The rates are worked out by recording rules from
counters the rank pushes anyway: nothing is added to a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

TERA = 1e12
PEAKS: tuple[tuple[tuple[str, ...], tuple[str, ...], dict[str, float]], ...] = (
    # (every one of these in the device name, none of these, peaks by dtype)
    (("B200",), (), {"bf16": 2250 * TERA, "fp16": 2250 * TERA, "fp8": 4500 * TERA, "tf32": 1100 * TERA}),
    (("H200",), (), {"bf16": 989.4 * TERA, "fp16": 989.4 * TERA, "fp8": 1978.9 * TERA, "tf32": 494.7 * TERA,
                     "fp32": 66.9 * TERA}),
    (("H100", "PCIe"), (), {"bf16": 756 * TERA, "fp16": 756 * TERA, "fp8": 1513 * TERA, "tf32": 378 * TERA,
                            "fp32": 51.2 * TERA}),
    (("H100", "NVL"), (), {"bf16": 835.5 * TERA, "fp16": 835.5 * TERA, "fp8": 1670.5 * TERA, "tf32": 417.5 * TERA,
                           "fp32": 60 * TERA}),
    (("H100",), ("PCIe", "NVL"), {"bf16": 989.4 * TERA, "fp16": 989.4 * TERA, "fp8": 1978.9 * TERA,
                                  "tf32": 494.7 * TERA, "fp32": 66.9 * TERA}),
    (("A100",), (), {"bf16": 312 * TERA, "fp16": 312 * TERA, "tf32": 156 * TERA, "fp32": 19.5 * TERA}),
    (("L40S",), (), {"bf16": 362.05 * TERA, "fp16": 362.05 * TERA, "fp8": 733 * TERA, "tf32": 183 * TERA,
                     "fp32": 91.6 * TERA}),
)
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.float8_e4m3fn: "fp8"}


def dtype_name(dtype: torch.dtype) -> str:
    """The table's name for ``dtype``: fp32 matmuls run as tf32 where torch allows it (a float32 matmul precision
    of "high" or "medium")."""
    name = DTYPES.get(dtype, str(dtype).removeprefix("torch."))
    if name == "fp32" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return name


def peak_flops(device_name: str, dtype: str) -> float:
    """The device's dense peak for ``dtype`` (a ``dtype_name``) in FLOP/s; 0 where the table has none."""
    for needed, excluded, peaks in PEAKS:
        if all(n in device_name for n in needed) and not any(x in device_name for x in excluded):
            return peaks.get(dtype, 0.0)
    return 0.0


def measure_flops(step: Callable[[], Any]) -> float:
    """The FLOPs of one call of ``step`` as torch's ``FlopCounterMode`` counts them (matrix multiplies, convolutions,
    attention; element-wise work is not counted, as MFU conventionally leaves it out).

    Call it once, before training, with a forward and backward of one batch, and pass the result as
    ``PatrolConfig(flops_per_step=...)`` (times the micro-batches of an optimizer step). It runs ``step`` for real
    under a dispatch mode that sees every operator, so that one call is slower than a step (several times, for a
    model of many small operators); the gradients it leaves are the caller's to zero. A model torch's counter
    has no formula for (a custom kernel) counts too low.

    Example::

        flops = trainpatrol.measure_flops(lambda: loss_fn(model(x), y).backward())
        optimizer.zero_grad(set_to_none=True)
    """
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    return float(counter.get_total_flops())
