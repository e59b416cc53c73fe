"""Local guards: checks on the values read back from the device, needing no Prometheus.

A tripped guard is counted (``trainpatrol_guard_trips_total{guard}``), shown while its condition
holds (``trainpatrol_guard_active{guard}``), logged once per trip, and handed to the control
policy, which by default pauses on non-finite loss or gradients.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from .memory import MemoryReading
from .window import History

log = logging.getLogger("trainpatrol")

GUARDS = ("nonfinite_loss", "nonfinite_grad", "loss_spike", "loss_stagnation", "grad_norm_explosion",
          "memory_fragmentation", "oom_risk")


@dataclass
class GuardConfig:
    loss_spike_factor: float = 4.0
    """Trip when the loss exceeds this many times its running median."""
    grad_norm_factor: float = 10.0
    """Trip when the grad norm exceeds this many times its running median..."""
    grad_norm_ceiling: float = 1e4
    """...or this absolute value."""
    median_window: int = 100
    median_refresh_steps: int = 16
    """The running medians are recomputed every this many steps, which keeps the guards O(1) a step."""
    min_steps: int = 20
    """Steps of history needed before the relative guards judge."""
    stagnation_steps: int = 1000
    stagnation_min_improvement: float = 0.001
    """Relative drop of the median loss, first half vs second half of the stagnation window."""
    fragmentation_ratio: float = 0.35
    fragmentation_min_reserved_bytes: float = 4 * 2**30
    oom_used_ratio: float = 0.92


class Guards:
    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self.trips: dict[str, int] = dict.fromkeys(GUARDS, 0)
        self.active: dict[str, bool] = dict.fromkeys(GUARDS, False)
        self._refreshed_at = -(10**9)
        self._samples = 0
        self._med_loss = math.nan
        self._med_gn = math.nan
        self._stagnant_now = False

    def _set(self, guard: str, condition: bool, detail: str, tripped: list[tuple[str, str]]) -> None:
        if condition and not self.active[guard]:
            self.trips[guard] += 1
            tripped.append((guard, detail))
            log.warning("trainpatrol guard %s tripped: %s", guard, detail)
        self.active[guard] = condition

    def check_step(self, step: int, loss: float, grad_norm: float | None, history: History) -> list[tuple[str, str]]:
        """Judge one read-back step. Returns the guards that tripped now, with a detail line."""
        c = self.config
        tripped: list[tuple[str, str]] = []
        self._set("nonfinite_loss", not math.isfinite(loss), f"loss {loss} at step {step}", tripped)
        if grad_norm is None:  # no norm computed this step: the gradient guards cannot judge
            grad_norm = 0.0
        self._set("nonfinite_grad", not math.isfinite(grad_norm), f"grad norm {grad_norm} at step {step}", tripped)
        self._refresh(step, history)
        enough = self._samples >= c.min_steps
        med_loss, med_gn = self._med_loss, self._med_gn
        spike = enough and math.isfinite(loss) and med_loss > 0 and loss > c.loss_spike_factor * med_loss
        self._set("loss_spike", spike,
                  f"loss {loss:.4g} > {c.loss_spike_factor} x median {med_loss:.4g} at step {step}", tripped)
        relative = enough and med_gn > 0 and grad_norm > c.grad_norm_factor * med_gn
        self._set("grad_norm_explosion", math.isfinite(grad_norm) and (relative or grad_norm > c.grad_norm_ceiling),
                  f"grad norm {grad_norm:.4g} (median {med_gn:.4g}, ceiling {c.grad_norm_ceiling:g}) at step {step}",
                  tripped)
        self._set("loss_stagnation", self._stagnant_now,
                  f"median loss improved < {c.stagnation_min_improvement:.1%} over {c.stagnation_steps} steps", tripped)
        return tripped

    def _refresh(self, step: int, history: History) -> None:
        c = self.config
        if step - self._refreshed_at < c.median_refresh_steps and self._samples >= c.min_steps:
            return
        self._refreshed_at = step
        losses = history.values("loss", c.median_window)
        self._samples = len(losses)
        self._med_loss = history.median("loss", c.median_window)
        self._med_gn = history.median("grad_norm", c.median_window)
        self._stagnant_now = self._stagnant(history)

    def _stagnant(self, history: History) -> bool:
        n = self.config.stagnation_steps
        losses = history.values("loss", n)
        if len(losses) < n:
            return False
        half = len(losses) // 2
        first, second = sorted(losses[:half])[half // 2], sorted(losses[half:])[(len(losses) - half) // 2]
        return first > 0 and (first - second) / first < self.config.stagnation_min_improvement

    def check_memory(self, m: MemoryReading) -> list[tuple[str, str]]:
        c = self.config
        tripped: list[tuple[str, str]] = []
        self._set("memory_fragmentation",
                  m.fragmentation > c.fragmentation_ratio and m.reserved > c.fragmentation_min_reserved_bytes,
                  f"fragmentation {m.fragmentation:.2f} with {m.reserved / 2**30:.1f} GiB reserved", tripped)
        self._set("oom_risk", m.used_ratio > c.oom_used_ratio,
                  f"allocated / capacity = {m.used_ratio:.3f}", tripped)
        return tripped
