"""Dense peak FLOP/s of the GPUs the project supports, by the dtype their matrix units compute in: MFU's denominator.

From NVIDIA's data sheets, without sparsity. A device or dtype not in the table has no peak (Patrol then exports no
MFU rather than a wrong one); ``PatrolConfig(peak_flops=)`` overrides the table.
"""

from __future__ import annotations

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
    """The table's name for ``dtype``: fp32 matmuls run as tf32 where torch allows it."""
    name = DTYPES.get(dtype, str(dtype).removeprefix("torch."))
    if name == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return name


def peak_flops(device_name: str, dtype: str) -> float:
    """The device's dense peak for ``dtype`` (a ``dtype_name``) in FLOP/s; 0 where the table has none."""
    for needed, excluded, peaks in PEAKS:
        if all(n in device_name for n in needed) and not any(x in device_name for x in excluded):
            return peaks.get(dtype, 0.0)
    return 0.0
