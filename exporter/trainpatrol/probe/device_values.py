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
        partial.append(torch.linalg.vector_norm(torch.stack(norms)).double())
    total: torch.Tensor = partial[0] if len(partial) == 1 else torch.linalg.vector_norm(torch.stack(partial))
    return total


class DeviceValues:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._nonfinite = torch.zeros(2, dtype=torch.float64, device=device)
        self._absent = torch.full((), ABSENT, dtype=torch.float64, device=device)
        self._one = torch.ones((), dtype=torch.float64, device=device)

    def vector(self, loss: torch.Tensor, grad_norm: torch.Tensor | float | None,
               scale: torch.Tensor | None) -> torch.Tensor:
        loss_d = loss.detach().reshape(()).to(self.device, torch.float64)
        if grad_norm is None:
            gn = self._absent
        elif isinstance(grad_norm, torch.Tensor):
            gn = grad_norm.detach().reshape(()).to(self.device, torch.float64)
        else:
            gn = torch.full((), float(grad_norm), dtype=torch.float64, device=self.device)
        sc = self._one if scale is None else scale.detach().reshape(()).to(self.device, torch.float64)
        values = torch.stack([loss_d, gn, sc])
        self._nonfinite.add_(~torch.isfinite(values[:2]))
        return torch.cat([values, self._nonfinite])
