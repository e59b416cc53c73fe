"""Hooks on the user's optimizer: skip a non-finite update, and act right after the step.

A step whose loss or gradients are non-finite must not reach the weights, or the checkpoint a pause
writes is poisoned. How the update is skipped depends on the optimizer, never with a host sync:

- ``found_inf``: torch's fused optimizers (``fused=True``: Adam, AdamW, SGD, Adagrad) take a device
  flag, as ``GradScaler`` gives them; the kernel leaves weights, moments and step counts untouched.
- ``hide_grads``: parameters on the CPU, where reading the flag costs nothing: the gradients are
  hidden for the step (optimizers skip a parameter without a gradient) and put back after it.
- ``off``: anything else (a non-fused optimizer on a GPU would need a sync). Checkpoints then record
  whether their state is finite, and ``restore("latest")`` passes over the poisoned ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from . import device_values as dv
from .flag_cost import FlagCost

log = logging.getLogger("trainpatrol")
_ABSENT = object()
Verdict = torch.Tensor | bool
"""Whether to skip the update: a host bool, or a float32 device flag (1.0: skip) as fused kernels take."""


def innermost(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under wrappers such as accelerate's ``AcceleratedOptimizer``."""
    seen = 0
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and seen < 8:
        optimizer, seen = optimizer.optimizer, seen + 1
    return optimizer  # type: ignore[no-any-return]


def skip_mode(optimizer: torch.optim.Optimizer) -> str:
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return "found_inf"
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if params and all(p.device.type == "cpu" for p in params):
        return "hide_grads"
    return "off"


class UpdateHooks:
    """Step pre- and post-hooks on ``optimizer``; ``judge`` hands over the closing step's verdict."""

    def __init__(self, optimizer: Any, *, skip: bool, after_step: Callable[[], None],
                 charge: Callable[[float], None] = lambda seconds: None) -> None:
        """``charge``: takes the hooks' own time, as Patrol's overhead."""
        self.optimizer = innermost(optimizer)
        self.mode = skip_mode(self.optimizer) if skip else "off"
        if skip and self.mode == "off":
            log.warning("trainpatrol: %s cannot skip a non-finite update on the GPU without a host sync; build it "
                        "with fused=True to have Patrol skip it. Until then a checkpoint written after a NaN is "
                        "marked non-finite and restore('latest') passes over it.", type(self.optimizer).__name__)
        self._after_step = after_step
        self._charge = charge
        self.judge_from_grads = False
        """Set when the loss is recorded only after the step (framework callbacks): ``judge`` is then ignored."""
        self._verdict: Verdict | None = None
        self._flag: torch.Tensor | None = None
        self._saved_found_inf: Any = _ABSENT
        self._set_found_inf = False
        self._hidden: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.flag_cost = FlagCost()
        """What torch's fused step adds on the host when handed the flag, timed in the loop."""
        self._handles = [self.optimizer.register_step_pre_hook(self._pre),
                         self.optimizer.register_step_post_hook(self._post)]

    def flag(self, value: torch.Tensor, extra: torch.Tensor | float | None = None) -> torch.Tensor:
        """The device verdict for ``value`` (and ``extra``), in a buffer reused every step: the kernel that
        reads it runs before the next step writes it, on the same stream."""
        return dv.nonfinite_flag(value, extra, self._buffer(value.device))

    def _buffer(self, device: torch.device) -> torch.Tensor:
        if self._flag is None or self._flag.device != device:
            self._flag = torch.zeros((), dtype=torch.float32, device=device)
        return self._flag

    def judge(self, skip: Verdict) -> None:
        """The verdict on the step about to be applied (``Patrol.step``, before ``optimizer.step()``)."""
        if self.mode != "off" and not self.judge_from_grads:
            self._verdict = skip

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        start = time.perf_counter()
        if self.mode != "off":
            verdict, self._verdict = self._verdict, None
            if verdict is None:  # Patrol.step did not judge this step (a framework that steps first): the grads tell
                norm = dv.total_grad_norm(self._params())  # type: ignore[arg-type]
                verdict = None if norm is None else self.flag(norm)  # None: no grads yet (a closure computes them)
            if verdict is not None:
                self.decide(verdict)
        self._charge(time.perf_counter() - start)

    def decide(self, skip: Verdict) -> None:
        """Skip the update being applied now if ``skip`` says so: from the pre-hook, or from inside ``step()``
        after a closure's backward (Lightning's ``on_before_optimizer_step``), before the update runs."""
        if self.mode == "hide_grads":
            if bool(skip):  # on the CPU a read is free
                self._hidden = [(p, p.grad) for p in self._params()]
                for p, _ in self._hidden:
                    p.grad = None
            return
        if self.mode != "found_inf":
            return
        optimizer = self.optimizer
        if not isinstance(skip, torch.Tensor):
            params = self._params()
            skip = torch.full((), float(skip), dtype=torch.float32,
                              device=params[0].device if params else torch.device("cpu"))
        self._charge(self.flag_cost.sample(self._params, time.perf_counter()))
        existing = getattr(optimizer, "found_inf", None)
        if not self._set_found_inf:
            self._saved_found_inf = getattr(optimizer, "found_inf", _ABSENT)
            self._set_found_inf = True
        # the kernels skip only on exactly 1.0 and subtract the flag from the step counts: keep it 0 or 1
        optimizer.found_inf = skip if existing is None else torch.maximum(existing, skip.to(existing.device))  # type: ignore[attr-defined]

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        start = time.perf_counter()
        self._verdict = None
        if self._hidden:
            for p, g in self._hidden:
                p.grad = g
            self._hidden = []
        if self._set_found_inf:  # GradScaler deletes its own flag after the step: hand it back as it was
            if self._saved_found_inf is _ABSENT:
                del optimizer.found_inf  # type: ignore[attr-defined]
            else:
                optimizer.found_inf = self._saved_found_inf  # type: ignore[attr-defined]
            self._saved_found_inf, self._set_found_inf = _ABSENT, False
        self._charge(time.perf_counter() - start)
        self._after_step()  # the boundary charges its own time
