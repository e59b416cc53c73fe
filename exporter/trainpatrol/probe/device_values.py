"""Builds the per-step device vector: loss, grad norm, loss scale, and running non-finite counts.

Everything stays on the device. The non-finite counts accumulate there too, so a NaN is counted
even if its step's read-back is skipped; the host reads the vector one step later.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

LOSS, GRAD_NORM, SCALE, NONFINITE_LOSS, NONFINITE_GRAD = range(5)
WIDTH = 5
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
    """Writes each step's values into one preallocated device buffer: 4 small kernels a step.

    Reusing the buffer is safe: the copy to the host is queued on the same stream before the next
    step's kernels overwrite it.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buf = torch.zeros(WIDTH, dtype=torch.float32, device=device)
        self._values = self._buf[:NONFINITE_LOSS]
        self._nonfinite = self._buf[NONFINITE_LOSS:]
        self._absent = torch.full((), ABSENT, dtype=torch.float32, device=device)
        self._one = torch.ones((), dtype=torch.float32, device=device)

    def _scalar(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().reshape(())
        return t if t.dtype == torch.float32 and t.device == self.device else t.to(self.device, torch.float32)

    def vector(self, loss: torch.Tensor, grad_norm: torch.Tensor | float | None,
               scale: torch.Tensor | None) -> torch.Tensor:
        if grad_norm is None:
            gn = self._absent
        elif isinstance(grad_norm, torch.Tensor):
            gn = self._scalar(grad_norm)
        else:
            gn = torch.full((), float(grad_norm), dtype=torch.float32, device=self.device)
        sc = self._one if scale is None else self._scalar(scale)
        torch.stack([self._scalar(loss), gn, sc], out=self._values)
        torch.add(self._nonfinite, torch.isfinite(self._values[:SCALE]).logical_not_(), out=self._nonfinite)
        return self._buf
