"""Keeps each step's loss, grad norm and loss scale on the device, in a ring of rows.

With the non-finite skip on, one kernel a step judges the step's values. Every few steps (``flush``) one kernel
stacks the batch's values into the ring, and the filled rows go to the host in one non-blocking copy. Every row is
read back (the host counts the non-finite ones), because the CPU can never run far enough ahead of the GPU to use
up the pinned buffers. On a launch-bound model each launch and each Python call shows in the step time, so the
views a step writes into are made once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch

log = logging.getLogger("trainpatrol")
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
    """Holds each step's values until ``flush`` stacks them into the ring, one kernel a batch. A value modified in
    place before then (``Tensor._version`` moved) would be read as modified; one a CUDA graph's replay overwrote
    (its memory takes the next step's value, its version stays) would be read as a later step's, or cannot be read
    at all. Patrol says so once, drops what it holds in the second case, and from then on copies each step's values
    into its row at once instead, one kernel a step.

    Reusing the ring is safe: the copy to the host is queued on the same stream before later
    steps' kernels overwrite a row."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buf = torch.zeros(WIDTH, dtype=DTYPE, device=device)
        self._rows = list(self._buf.view(ROWS, ROW).unbind())
        self._heads = [self._buf[:n * ROW] for n in range(ROWS + 1)]
        """The first n rows, the view ``flush`` stacks a held batch into."""
        self._flags = torch.zeros(ROWS, dtype=torch.float32, device=device)
        self._flag_of = list(self._flags.unbind())
        self._absent = torch.full((), ABSENT, dtype=DTYPE, device=device)
        self._one = torch.ones((), dtype=torch.float32, device=device)
        self._held: list[torch.Tensor] = []
        self._versions: list[int] = []
        self._memory: set[int] = set()
        """Where the held values lie (``data_ptr``)."""
        self.copy_each_step = False
        self.filled = 0

    def _scalar(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as a 0-dim ``DTYPE`` tensor on this device (a [1]-shaped value, a pipeline's last stage)."""
        t = t.detach()
        if t.dim():
            t = t.reshape(())
        return t.to(self.device, DTYPE)

    def record(self, loss: torch.Tensor, grad_norm: torch.Tensor | float | None, scale: torch.Tensor | None,
               judge: bool) -> torch.Tensor | None:
        """Take one step's values (call ``flush`` before ``ROWS`` rows are filled). ``judge``: return a float32
        device flag, 1.0 when one of them is NaN/Inf, as fused optimizers take it (``found_inf``)."""
        gn = grad_norm.detach() if isinstance(grad_norm, torch.Tensor) else self._constant(grad_norm)
        loss = loss.detach()
        if loss.ndim or gn.ndim or loss.dtype != DTYPE or gn.dtype != DTYPE:
            loss, gn = self._scalar(loss), self._scalar(gn)
        memory = () if self.copy_each_step else self._memory_of(loss, gn)
        if memory is None or not self._memory.isdisjoint(memory):
            self._copy_from_now("shares its memory with an earlier step's, and overwrote it (a CUDA graph's output, "
                                "which each replay writes); the values held since the last read-back are lost")
            self._held, self._versions, self.filled = [], [], 0
        i = self.filled
        self.filled = i + 1
        if i == 0 and judge:  # the flags of the last batch were all read by optimizer steps queued before this one
            self._flags.zero_()
        # the loss scale changes in place (GradScaler.update): a copy of this step's
        values: tuple[torch.Tensor, ...] = (loss, gn) if scale is None else (loss, gn, self._scalar(scale).clone())
        flag = None
        if judge:  # GradScaler's own check kernel: it multiplies the values by 1.0, leaving them as they were
            flag = self._flag_of[i]
            try:
                torch._amp_foreach_non_finite_check_and_unscale_(values, flag, self._one)
            except (AttributeError, RuntimeError):  # a private API; a value on another device (a pipeline's
                values = tuple(self._scalar(v) for v in values)  # last stage) or made in inference mode
                loss, gn = values[LOSS], values[GRAD_NORM]
                memory = self._memory_of(loss, gn)  # copies of the values, if made: those are held
                nonfinite_flag(torch.stack(values).sum(), None, flag)
        row = values if scale is not None else (loss, gn, self._one)
        if self.copy_each_step:
            self._stack(row, self._rows[i])
            return flag
        try:
            versions = (loss._version, gn._version, row[SCALE]._version)
        except RuntimeError:  # inside inference_mode a tensor keeps no version: copied, as a tensor that does
            with torch.inference_mode(False):
                row = (loss.clone(), gn.clone(), row[SCALE].clone())
            versions = (row[LOSS]._version, row[GRAD_NORM]._version, row[SCALE]._version)
            memory = self._memory_of(row[LOSS], row[GRAD_NORM])
        self._held += row
        self._versions += versions
        self._memory.update(memory or ())
        return flag

    def _memory_of(self, loss: torch.Tensor, gn: torch.Tensor) -> tuple[int, ...] | None:
        """Where a step's loss and grad norm lie (``data_ptr``; None: unreadable, a CUDA graph's output that torch
        marked as overwritten). Memory a held tensor owns is never handed out again, so a step whose values lie
        where a held value lies was written outside the allocator: a CUDA graph's replay, which leaves the version
        as it was. Patrol's own constant (no grad norm) lies in the same place every step."""
        try:
            return (loss.data_ptr(),) if gn is self._absent else (loss.data_ptr(), gn.data_ptr())
        except RuntimeError:
            return None

    def _stack(self, values: tuple[torch.Tensor, ...] | list[torch.Tensor], out: torch.Tensor) -> None:
        try:
            torch.stack(values, out=out)
        except RuntimeError:  # a value on another device (a pipeline's last stage)
            torch.stack([self._scalar(v) for v in values], out=out)

    def _constant(self, value: float | None) -> torch.Tensor:
        if value is None:
            return self._absent
        return torch.full((), float(value), dtype=DTYPE, device=self.device)

    def flush(self) -> tuple[int, torch.Tensor]:
        """Returns (filled rows, the buffer to copy to the host) and starts a new batch."""
        n, self.filled = self.filled, 0
        held, self._held = self._held, []
        self._memory.clear()
        if held:
            versions, self._versions = self._versions, []
            if any(t._version != v for t, v in zip(held, versions, strict=True)):
                self._copy_from_now("was modified in place before Patrol read it")
            try:
                self._stack(held, self._heads[n])
            except RuntimeError as exc:  # an output of a CUDA graph that a later replay overwrote
                self._copy_from_now(f"could not be read a few steps later ({exc}); this batch's values are lost")
                return 0, self._buf
        return n, self._buf

    def _copy_from_now(self, why: str) -> None:
        log.warning("trainpatrol: a loss or grad norm given to patrol.step() %s; Patrol now copies each step's "
                    "values at once (one more kernel a step)", why)
        self.copy_each_step = True


def unpack(first_step: int, rows: int, values: list[float]) -> list[tuple[int, float, float, float]]:
    """Host side: [(step, loss, grad norm, scale), ...]."""
    return [(first_step + i, values[i * ROW + LOSS], values[i * ROW + GRAD_NORM], values[i * ROW + SCALE])
            for i in range(rows)]
