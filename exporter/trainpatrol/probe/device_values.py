"""Keeps each step's loss, grad norm and loss scale on the device, in a ring of rows.

One kernel a step writes a row. Every few steps (``flush``) the filled rows go to the host in one
non-blocking copy, so a fast step pays for about one kernel launch. Every row is read back (the
host counts the non-finite ones), because the CPU can never run far enough ahead of the GPU to use
up the pinned buffers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

LOSS, GRAD_NORM, SCALE = range(3)
ROW = 3
ROWS = 16
WIDTH = ROWS * ROW
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


class DeviceValues:
    """Reusing the ring is safe: the copy to the host is queued on the same stream before later
    steps' kernels overwrite a row."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # float64 so a float64 loss reads back exactly; stack() casts into it inside its one kernel
        self._buf = torch.zeros(WIDTH, dtype=torch.float64, device=device)
        self._rows = self._buf.view(ROWS, ROW)
        self._absent = torch.full((), ABSENT, dtype=torch.float32, device=device)
        self._one = torch.ones((), dtype=torch.float32, device=device)
        self.filled = 0

    def _scalar(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().reshape(())
        return t if t.device == self.device else t.to(self.device)

    def record(self, loss: torch.Tensor, grad_norm: torch.Tensor | float | None,
               scale: torch.Tensor | None) -> torch.Tensor:
        """Write one step's row and return it (call ``flush`` before ``ROWS`` rows are filled)."""
        if grad_norm is None:
            gn = self._absent
        elif isinstance(grad_norm, torch.Tensor):
            gn = self._scalar(grad_norm)
        else:
            gn = torch.full((), float(grad_norm), dtype=torch.float64, device=self.device)
        sc = self._one if scale is None else self._scalar(scale)
        row = self._rows[self.filled]
        torch.stack([self._scalar(loss), gn, sc], out=row)
        self.filled += 1
        return row

    def flush(self) -> tuple[int, torch.Tensor]:
        """Returns (filled rows, the buffer to copy to the host) and starts a new batch."""
        n, self.filled = self.filled, 0
        return n, self._buf


def unpack(first_step: int, rows: int, values: list[float]) -> list[tuple[int, float, float, float]]:
    """Host side: [(step, loss, grad norm, scale), ...]."""
    return [(first_step + i, values[i * ROW + LOSS], values[i * ROW + GRAD_NORM], values[i * ROW + SCALE])
            for i in range(rows)]
