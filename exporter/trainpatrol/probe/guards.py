"""Local guards: checks on the values read back from the device, needing no Prometheus.

A tripped guard is counted (``trainpatrol_guard_trips_total{guard}``), shown while its condition
holds (``trainpatrol_guard_active{guard}``), and handed to the control policy, which by default
pauses on non-finite loss or gradients. Its first trip is logged; a guard that keeps flapping is
logged at most once per ``log_interval_seconds``, with the number of trips in between.

A step costs O(1): the detail line is formatted only when a guard trips, the running medians are
recomputed every ``median_refresh_steps`` steps and the stagnation test every twentieth of its window;
in between, a step with both values finite and under limits set at the refresh returns at once.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .host_memory import HostMemoryReading, LeakTrend
from .memory import MemoryReading
from .window import History, finite

log = logging.getLogger("trainpatrol")

GUARDS = ("nonfinite_loss", "nonfinite_grad", "loss_spike", "loss_stagnation", "grad_norm_explosion",
          "memory_fragmentation", "oom_risk", "host_memory_leak")
STEP_GUARDS = GUARDS[:5]
"""The guards ``check_step`` judges."""
_MAX = sys.float_info.max


@dataclass
class GuardConfig:
    loss_spike_factor: float = 4.0
    """Trip when the loss exceeds this many times its running median (healthy H200 runs peaked at 1.47x)."""
    grad_norm_factor: float = 50.0
    """Trip when the grad norm exceeds this many times its running median (healthy H200 runs peaked at 23.8x;
    see docs/benchmarks.md)..."""
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
    log_interval_seconds: float = 60.0
    """A guard that trips again is logged at most this often (each trip is still counted and acted on)."""
    fragmentation_ratio: float = 0.35
    """Trip when this share of reserved memory stayed unusable even at the allocation peak..."""
    fragmentation_min_reserved_bytes: float = 4 * 2**30
    """...with at least this much reserved; or whenever the allocator had to free its cache and retry."""
    oom_used_ratio: float = 0.92
    host_memory_used_ratio: float = 0.9
    """host_memory_leak trips when the rank's resident set (with its workers' growth) passes this share of the
    limit (see probe/host_memory.py)..."""
    host_memory_min_growth_bytes_per_second: float = 2.0**20
    host_memory_horizon_seconds: float = 600.0
    """...or when it grew at this rate or more, throughout the last ``host_memory_min_seconds`` or more, and at
    that rate reaches the limit within this horizon."""
    host_memory_window_seconds: float = 30.0
    host_memory_min_seconds: float = 15.0


class Guards:
    def __init__(self, config: GuardConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.trips: dict[str, int] = dict.fromkeys(GUARDS, 0)
        self.active: dict[str, bool] = dict.fromkeys(GUARDS, False)
        self._logged_at: dict[str, float] = {}
        self.trip_log: deque[dict[str, object]] = deque(maxlen=256)
        """The latest trips with their detail lines, for evidence bundles (the log rate-limits its lines)."""
        self._unlogged: dict[str, int] = dict.fromkeys(GUARDS, 0)
        self._next_refresh = -math.inf
        self._stagnation_at = -(10**9)
        self._samples = 0
        self._med_loss = math.nan
        self._med_gn = math.nan
        self._stagnant_now = False
        self._loss_limit = self._gn_limit = _MAX
        """Between refreshes, a step with both values in [-max float, limit] trips nothing new."""
        self._quiet = True
        """No step guard is active."""
        self._alloc_retries: float | None = None
        self._host_trend = LeakTrend(config.host_memory_window_seconds)
        self._host_tripped_at = self._host_leaking_at = 0.0
        """The judged host memory when host_memory_leak last tripped; when its trend last showed a leak."""

    def rearm(self) -> None:
        """Forget which conditions hold, so one that still holds trips (and acts) again at its next step."""
        self.active = dict.fromkeys(GUARDS, False)
        self._quiet = True

    def _set(self, guard: str, condition: bool, detail: Callable[[], str], tripped: list[tuple[str, str]]) -> None:
        if condition and not self.active[guard]:
            self.trips[guard] += 1
            line = detail()
            tripped.append((guard, line))
            self.trip_log.append({"time": time.time(), "guard": guard, "detail": line})
            self._log(guard, line)
        self.active[guard] = condition

    def _log(self, guard: str, line: str) -> None:
        now = self.clock()
        last = self._logged_at.get(guard)
        if last is not None and now - last < self.config.log_interval_seconds:
            self._unlogged[guard] += 1
            return
        since = self._unlogged[guard]
        more = f" ({since} more trips since the last log line)" if since else ""
        log.warning("trainpatrol guard %s tripped: %s%s", guard, line, more)
        self._logged_at[guard], self._unlogged[guard] = now, 0

    def check_step(self, step: int, loss: float, grad_norm: float | None, history: History) -> list[tuple[str, str]]:
        """Judge one read-back step. Returns the guards that tripped now, with a detail line."""
        gn = 0.0 if grad_norm is None else grad_norm  # no norm this step: the gradient guards cannot judge
        if step >= self._next_refresh:
            self._refresh(step, history)
        if -_MAX <= loss <= self._loss_limit and -_MAX <= gn <= self._gn_limit and self._quiet \
                and not self._stagnant_now:
            return []  # the common step: finite, below both limits, nothing to clear
        c = self.config
        tripped: list[tuple[str, str]] = []
        if not (math.isfinite(loss) and math.isfinite(gn)) or self.active["nonfinite_loss"] \
                or self.active["nonfinite_grad"]:
            self._set("nonfinite_loss", not math.isfinite(loss), lambda: f"loss {loss} at step {step}", tripped)
            self._set("nonfinite_grad", not math.isfinite(gn), lambda: f"grad norm {gn} at step {step}", tripped)
        enough = self._samples >= c.min_steps
        med_loss, med_gn = self._med_loss, self._med_gn
        spike = enough and math.isfinite(loss) and med_loss > 0 and loss > c.loss_spike_factor * med_loss
        if spike or self.active["loss_spike"]:
            self._set("loss_spike", spike, lambda: f"loss {loss:.4g} > {c.loss_spike_factor} x median "
                                                   f"{med_loss:.4g} at step {step}", tripped)
        exploded = math.isfinite(gn) and ((enough and med_gn > 0 and gn > c.grad_norm_factor * med_gn)
                                          or gn > c.grad_norm_ceiling)
        if exploded or self.active["grad_norm_explosion"]:
            self._set("grad_norm_explosion", exploded,
                      lambda: f"grad norm {gn:.4g} (median {med_gn:.4g}, ceiling {c.grad_norm_ceiling:g}) "
                              f"at step {step}", tripped)
        if self._stagnant_now or self.active["loss_stagnation"]:
            self._set("loss_stagnation", self._stagnant_now,
                      lambda: f"median loss improved < {c.stagnation_min_improvement:.1%} over "
                              f"{c.stagnation_steps} steps", tripped)
        self._quiet = not any(self.active[g] for g in STEP_GUARDS)
        return tripped

    def _refresh(self, step: int, history: History) -> None:
        c = self.config
        window = history.recent(c.median_window)
        losses = finite([r.loss for r in window])
        norms = finite([r.grad_norm for r in window])
        self._samples = len(losses)
        self._med_loss = _median(losses) if losses else math.nan
        self._med_gn = _median(norms) if norms else math.nan
        enough = self._samples >= c.min_steps
        self._next_refresh = step + c.median_refresh_steps if enough else -math.inf
        self._loss_limit = min(c.loss_spike_factor * self._med_loss if enough and self._med_loss > 0 else _MAX, _MAX)
        self._gn_limit = min(c.grad_norm_factor * self._med_gn if enough and self._med_gn > 0 else _MAX,
                             c.grad_norm_ceiling, _MAX)
        if step - self._stagnation_at >= max(c.median_refresh_steps, c.stagnation_steps // 20):
            self._stagnation_at = step
            self._stagnant_now = self._stagnant(history)

    def _stagnant(self, history: History) -> bool:
        """The median of the older half of the last ``stagnation_steps`` finite losses is not beaten by
        enough by the newer half's. The newest records (the step being judged, and on CUDA up to a
        read-back batch) have no loss yet, so the window reaches back over them."""
        n = self.config.stagnation_steps
        if len(history.records) < n:
            return False
        losses = finite([r.loss for r in history.recent(n + self.config.median_refresh_steps)])[-n:]
        if len(losses) < n:
            return False
        half = len(losses) // 2
        first, second = _median(losses[:half]), _median(losses[half:])
        return first > 0 and (first - second) / first < self.config.stagnation_min_improvement

    def check_memory(self, m: MemoryReading) -> list[tuple[str, str]]:
        c = self.config
        tripped: list[tuple[str, str]] = []
        retried = self._alloc_retries is not None and m.alloc_retries > self._alloc_retries
        retries_before, self._alloc_retries = self._alloc_retries, m.alloc_retries
        unusable = m.fragmentation > c.fragmentation_ratio and m.reserved > c.fragmentation_min_reserved_bytes
        self._set("memory_fragmentation", retried or unusable,
                  lambda: f"{m.unusable_at_peak / 2**30:.2f} GiB of {m.reserved / 2**30:.1f} GiB reserved unusable "
                          f"even at the allocation peak ({m.fragmentation:.2f}); inactive split blocks "
                          f"{m.inactive_split / 2**30:.2f} GiB; allocator retries {retries_before or 0:g} -> "
                          f"{m.alloc_retries:g}", tripped)
        self._set("oom_risk", m.used_ratio > c.oom_used_ratio,
                  lambda: f"allocated / capacity = {m.used_ratio:.3f}", tripped)
        return tripped

    def check_host_memory(self, r: HostMemoryReading) -> list[tuple[str, str]]:
        """Judge a host-memory reading: on the publisher thread, about once a second (Patrol.snapshot)."""
        c = self.config
        tripped: list[tuple[str, str]] = []
        self._host_trend.add(r.time, r.judged)
        why = self._host_trend.leak(r.budget, used_ratio=c.host_memory_used_ratio,
                                    min_growth=c.host_memory_min_growth_bytes_per_second,
                                    horizon=c.host_memory_horizon_seconds, min_seconds=c.host_memory_min_seconds)
        # A leak does not heal when its growth pauses (a loaded machine slows the loop): once tripped, the guard
        # stays active until the memory falls below where it tripped, or until its trend has shown no leak for two
        # windows (a pause of up to a window, and the window the trend then needs to show the growth again), so
        # one leak captures once.
        if why is not None:
            self._host_leaking_at = r.time
        held = (self.active["host_memory_leak"] and r.judged >= self._host_tripped_at
                and r.time - self._host_leaking_at < 2 * c.host_memory_window_seconds)
        self._set("host_memory_leak", why is not None or held, lambda: str(why), tripped)
        if tripped:
            self._host_tripped_at = r.judged
        return tripped


def _median(values: list[float]) -> float:
    """``float(statistics.median(values))`` for a non-empty list, which it sorts in place."""
    values.sort()
    n = len(values)
    i = n // 2
    return float(values[i] if n % 2 else (values[i - 1] + values[i]) / 2)
