"""Keeps each step's loss, grad norm and loss scale on the device, in a ring of rows.

One kernel a step writes a row, and with the non-finite skip on, one more judges it. Every few steps
(``flush``) the filled rows go to the host in one non-blocking copy. Every row is read back (the
host counts the non-finite ones), because the CPU can never run far enough ahead of the GPU to use
up the pinned buffers. On a launch-bound model each launch and each Python call shows in the step
time, so the views a step writes into are made once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

LOSS, GRAD_NORM, SCALE = range(3)
ROW = 3
ROWS = 16
WIDTH = ROWS * ROW
DTYPE = torch.float32
"""The ring's type: a float32 or bfloat16 loss reads back exactly, and a row of float32 inputs is written by
one kernel (a float64 ring would add a cast per input)."""
ABSENT = -1.0
"""Grad-norm slot value when no norm was computed (no model given, no norm passed)."""


def total_grad_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
    """Global L2 norm of all gradients with ``torch._foreach_norm``, one call per dtype."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if g is not None:
            groups.setdefault((g.device, g.dtype), []).append(g.detach())
    if not groups:
        return None
    partial = []
    for grads in groups.values():
        norms = torch._foreach_norm(grads, 2.0)
        partial.append(torch.linalg.vector_norm(torch.stack(norms)).float())
    total: torch.Tensor = partial[0] if len(partial) == 1 else torch.linalg.vector_norm(torch.stack(partial))
    return total


def nonfinite_flag(value: torch.Tensor, extra: torch.Tensor | float | None, out: torch.Tensor) -> torch.Tensor:
    """``out`` (float32) = 1.0 if ``value`` or ``extra`` is NaN/Inf, else 0.0, in three kernels and no sync:
    x * 0 is 0 for a finite x and NaN otherwise (Inf too), and nan_to_num turns that NaN into 1."""
    x = value.detach()
    if isinstance(extra, torch.Tensor):
        x = x + extra.detach()
    elif extra is not None and not math.isfinite(extra):
        return out.fill_(1.0)
    torch.mul(x, 0.0, out=out)
    return out.nan_to_num_(nan=1.0)


class DeviceValues:
    """Reusing the ring is safe: the copy to the host is queued on the same stream before later
    steps' kernels overwrite a row."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buf = torch.zeros(WIDTH, dtype=DTYPE, device=device)
        self._rows = list(self._buf.view(ROWS, ROW).unbind())
        self._flags = torch.zeros(ROWS, dtype=torch.float32, device=device)
        self._flag_of = list(self._flags.unbind())
        self._absent = torch.full((), ABSENT, dtype=DTYPE, device=device)
        self._one = torch.ones((), dtype=torch.float32, device=device)
        self.filled = 0

    def _scalar(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.dim():
            t = t.reshape(())
        return t if t.device == self.device else t.to(self.device)

    def record(self, loss: torch.Tensor, grad_norm: torch.Tensor | float | None,
               scale: torch.Tensor | None) -> torch.Tensor:
        """Write one step's row and return it (call ``flush`` before ``ROWS`` rows are filled)."""
        if grad_norm is None:
            gn = self._absent
        elif isinstance(grad_norm, torch.Tensor):
            gn = grad_norm.detach()
        else:
            gn = torch.full((), float(grad_norm), dtype=DTYPE, device=self.device)
        sc = self._one if scale is None else scale.detach()
        if self.filled == 0:
            # the flags of the last batch were all read by optimizer steps queued before this one
            self._flags.zero_()
        row = self._rows[self.filled]
        values = [loss.detach(), gn, sc]
        try:  # the usual step: 0-dim values on this device, one kernel and no checks of ours
            if values[0].dim() or gn.dim():
                raise RuntimeError("not 0-dim")
            torch.stack(values, out=row)
        except RuntimeError:  # a [1]-shaped value, or one on another device (a pipeline's last stage)
            torch.stack([self._scalar(v) for v in values], out=row)
        self.filled += 1
        return row

    def nonfinite(self) -> torch.Tensor:
        """A float32 device flag, 1.0 when the last recorded row holds a NaN/Inf, as fused optimizers take it
        (``found_inf``): GradScaler's own check kernel, which multiplies the row by 1.0 and so leaves it as it
        was, into the row's own pre-zeroed flag."""
        i = self.filled - 1
        flag = self._flag_of[i]
        try:
            torch._amp_foreach_non_finite_check_and_unscale_([self._rows[i]], flag, self._one)
        except (AttributeError, RuntimeError):  # private API: fall back to the public ops
            return nonfinite_flag(self._rows[i].sum(), None, flag)
        return flag

    def flush(self) -> tuple[int, torch.Tensor]:
        """Returns (filled rows, the buffer to copy to the host) and starts a new batch."""
        n, self.filled = self.filled, 0
        return n, self._buf


def unpack(first_step: int, rows: int, values: list[float]) -> list[tuple[int, float, float, float]]:
    """Host side: [(step, loss, grad norm, scale), ...]."""
    return [(first_step + i, values[i * ROW + LOSS], values[i * ROW + GRAD_NORM], values[i * ROW + SCALE])
            for i in range(rows)]
