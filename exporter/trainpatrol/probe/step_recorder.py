"""Records the training steps: the hot path of ``Patrol.step``.

A step appends one row of host facts (its end, duration, loader wait, learning rate) to a batch that
is folded into history, totals and guards about every ``readback_lag_seconds`` (``fold_in``), so the
per-step Python is a handful of attribute writes. On CUDA the step's loss, grad norm and loss scale
stay on the device (one kernel a step for the non-finite verdict); when the batch is folded in they are
stacked into a device ring (one kernel) and copied non-blocking to pinned memory, and read back at a
later fold, once they have landed: never a host-device sync. On CPU a value is read at once (for
free), and a non-finite value or a due allocator read folds the batch in at once. Both fold their
values in through one path, ``_absorb_values``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from . import device_values as dv
from .compute_clock import ComputeClock
from .config import PatrolConfig
from .exposure import Exposure
from .guards import Guards
from .memory import default_reader
from .metrics_state import Latest, Totals
from .readback import Readback
from .update_hooks import UpdateHooks
from .window import History, StepRecord

log = logging.getLogger("trainpatrol")
JUDGED_AT_ONCE = {"nonfinite_loss", "nonfinite_grad", "memory_fragmentation", "oom_risk", "host_memory_leak"}
"""Guards whose action never waits for a CPU batch (see ``record``, ``read_memory``)."""
CLIPPED_NORM_STEPS = 8
"""Steps in a row with the same grad norm (to 1e-5) that mean it was read after clipping."""
Row = list[Any]
"""A step not yet folded in: [step, end, seconds, loader wait, loss, grad norm, scale, learning rate (as the
optimizer holds it), probe seconds]; on CUDA loss, grad norm and scale are NaN here and come with the read-back."""
STEP, END, SECONDS, WAIT, LOSS, GRAD_NORM, SCALE, LEARNING_RATE, PROBE = range(9)


def _learning_rate(lr: Any) -> float:
    """A param group's learning rate as a float, read without a sync (a tensor on a device stays unread)."""
    if isinstance(lr, int | float) or (isinstance(lr, torch.Tensor) and lr.device.type == "cpu"):
        return float(lr)
    return math.nan


class StepRecorder:
    def __init__(self, config: PatrolConfig, device: torch.device, history: History, totals: Totals, latest: Latest,
                 guards: Guards, trip: Callable[[list[tuple[str, str]]], None],
                 params: list[torch.nn.Parameter]) -> None:
        self.config, self.device, self.history, self.totals, self.latest = config, device, history, totals, latest
        self.guards, self.trip, self._params = guards, trip, params
        self.hooks: UpdateHooks | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler: Any = None
        self._values = dv.DeviceValues(device)
        self._readback = Readback(device, dv.WIDTH)
        self._exposure = Exposure(torch.cuda.Event)
        self.on_cpu = device.type == "cpu"
        self._rows: list[Row] = []
        self._batch = 1
        """Steps a batch holds before it is folded in: about ``readback_lag_seconds`` of them, at most ``dv.ROWS``."""
        self._batch_steps = not self.on_cpu or not config.guard_actions.keys() - JUDGED_AT_ONCE
        """Whether steps may wait in a batch: on CPU not when a guard judged there may act, as its action must
        come at the next boundary (non-finite values and memory readings are judged at once there)."""
        self.owner = threading.get_ident()
        """The thread that records steps: only it folds the CPU batch in (see ``RankReport.snapshot``)."""
        self._memory_reader = config.memory_reader or default_reader(device)
        self._memory_due = -math.inf if self._memory_reader is not None else math.inf
        self._lrs: list[Any] | None = None
        """The last step's param-group learning rates, until ``latest`` takes them."""
        self._loss_sum: torch.Tensor | None = None
        self._wait_since_step = 0.0
        self.probe_since_step = 0.0
        self.last_step_end = time.perf_counter()
        self.compute_clock: ComputeClock | None = None
        """Times the rank's forward and backward apart from its waits for peers (set when Patrol has a model)."""
        self._last_scale = math.nan
        self._same_norm, self._same_norm_steps, self._warned_clipped = math.nan, 0, False

    @property
    def rows_waiting(self) -> bool:
        return bool(self._rows)

    def waited(self, seconds: float) -> None:
        self._wait_since_step += seconds
        self.totals.loader_wait += seconds

    def fetched(self, start: float, end: float) -> None:
        """The loader wrapper waited for a batch from ``start`` to ``end``; its own time from then on is Patrol's."""
        wait = end - start
        self._wait_since_step += wait
        self.totals.loader_wait += wait
        self.probe_since_step += time.perf_counter() - end

    def charge(self, seconds: float) -> None:
        """Patrol's own time spent outside ``record`` (the optimizer hooks, the boundary), counted with the next
        step in ``trainpatrol_probe_overhead_ratio``."""
        self.probe_since_step += seconds

    def start_at(self, step: int) -> None:
        self.fold_in()
        self.totals.steps = step
        self.totals.micro_steps = step * self.config.grad_accum_steps
        self.last_step_end = time.perf_counter()

    def record(self, loss: torch.Tensor, grad_norm: torch.Tensor | float | None, batch_size: int | None,
               tokens: int | None, learning_rates: list[float] | None, start: float) -> bool:
        """One micro-step (see ``Patrol.step``), which began at ``start`` (``time.perf_counter``): Patrol's time
        from then on. Returns whether it closed an optimizer step."""
        t = self.totals
        t.micro_steps += 1
        if batch_size:
            t.samples += batch_size
        if tokens:
            t.tokens += tokens
        accum = self.config.grad_accum_steps
        if accum > 1:
            detached = loss.detach()
            self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
            if t.micro_steps % accum:
                self.probe_since_step += time.perf_counter() - start
                return False
            mean_loss, self._loss_sum = self._loss_sum / accum, None
        else:
            mean_loss = loss
        if grad_norm is None and self._params:
            grad_norm = dv.total_grad_norm(self._params)
        scale = None
        if self.scaler is not None and getattr(self.scaler, "is_enabled", lambda: False)():
            scale = getattr(self.scaler, "_scale", None)
        t.steps += 1
        lr: Any = math.nan
        if learning_rates is not None:
            self.latest.learning_rates, self._lrs = list(learning_rates), None
            lr = learning_rates[0] if learning_rates else math.nan
        elif self.optimizer is not None:
            lrs: list[Any] = []  # a plain loop is the cheapest way in situ; _take_lrs filters
            for group in self.optimizer.param_groups:
                lrs.append(group.get("lr"))
            self._lrs = lrs
            lr = lrs[0] if lrs else math.nan
        hooks = self.hooks
        if self.on_cpu:  # a value is read for free (item(): no detach, no warning)
            loss_f = float(mean_loss.item())
            gn_f = dv.ABSENT if grad_norm is None else \
                float(grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm)
            scale_f = 1.0 if scale is None else float(scale.item() if isinstance(scale, torch.Tensor) else scale)
            both = loss_f + gn_f
            urgent = both - both != 0  # NaN/Inf in either (an absent norm is a finite -1): judged at once
            if hooks is not None:
                hooks.judge(urgent)
        else:  # the values stay on the device until the batch's read-back
            self._exposure.begin()
            values = self._values
            judge = hooks is not None and hooks.mode != "off"
            flag = values.record(mean_loss, grad_norm, scale, judge)
            if flag is not None:
                hooks.judge(flag)  # type: ignore[union-attr]
            loss_f = gn_f = scale_f = math.nan
            urgent = values.filled == dv.ROWS
        rows = self._rows
        if not rows:
            self.owner = threading.get_ident()
        if self.compute_clock is not None:
            self.probe_since_step += self.compute_clock.step(start)
        row = [t.steps, start, start - self.last_step_end, self._wait_since_step, loss_f, gn_f, scale_f, lr, 0.0]
        rows.append(row)
        self.last_step_end = start
        self._wait_since_step = 0.0
        if urgent or len(rows) >= self._batch or start >= self._memory_due:
            self.fold_in(start >= self._memory_due)
            self.history.records[-1].probe_seconds = self.probe_since_step + (time.perf_counter() - start)
        else:
            row[PROBE] = self.probe_since_step + (time.perf_counter() - start)
        self.probe_since_step = 0.0
        self._exposure.end()
        return True

    def _open_record(self, step: int, wall: float, seconds: float, wait: float) -> StepRecord:
        """A step's record, before its values are read."""
        rec = self.history.record(step, wall)
        rec.step_seconds, rec.loader_wait_seconds = seconds, wait
        self.totals.observe_step(seconds)
        return rec

    def _take_lrs(self) -> None:
        """The last step's param-group learning rates, as read, into ``latest``."""
        if self._lrs is not None:
            self.latest.learning_rates = [float(v) for v in self._lrs if isinstance(v, (float, int))]
            self._lrs = None

    def read_memory(self, step: int, now: float | None = None) -> None:
        """Read the allocator into ``step``'s record; ``now``: a timed read, the next one due an interval later."""
        if self._memory_reader is None:
            return
        if now is not None:
            self._memory_due = now + self.config.memory_interval_seconds
        m = self._memory_reader()
        if m is None:
            return
        prev = self.latest.memory
        if prev is not None:
            m = replace(m, peak_seen=max(prev.peak_seen, prev.peak_allocated))
        rec = self.history.get(step)
        if rec is not None:
            rec.allocated_bytes, rec.reserved_bytes = m.allocated, m.reserved
            rec.fragmentation_ratio = m.fragmentation
        rose = prev is not None and m.peak_allocated > prev.peak_allocated
        self.latest.window_peak = max(self.history.max("allocated_bytes"), m.peak_allocated if rose else 0.0)
        self.latest.memory = m
        self.trip(self.guards.check_memory(m))

    def catch_up(self, *, wait: bool) -> None:
        """Fold in every step recorded so far, with its device values (``wait``: the copies still in flight
        too, else those already landed)."""
        self.fold_in()
        if wait:
            self._absorb(self._readback.drain())

    def _flush(self) -> None:
        """Send the device ring's filled rows to the host, to be read back once they land."""
        if self._values.filled:
            rows, buf = self._values.flush()
            if not rows:  # the batch's values could not be read (DeviceValues said why)
                return
            self._readback.submit((self.totals.steps - rows + 1, rows), buf)
            self._exposure.due()
            self.latest.exposed_share = self._exposure.share

    def _absorb(self, values: list[tuple[tuple[int, int], list[float]]]) -> None:
        """Fold read-back device values (late by a step or a few) into history, totals and guards."""
        for (first, rows), v in values:
            for step, loss, raw_gn, scale in dv.unpack(first, rows, v):
                self._absorb_values(self.history.get(step), step, loss, raw_gn, scale)

    def fold_in(self, read_memory: bool = False) -> None:
        """Fold the pending rows into history, totals and guards in step order (``read_memory``: an allocator
        read at the last row); on CUDA send their device values to the host and absorb those that landed."""
        rows = self._rows
        if rows:
            self._rows = []
            self._take_lrs()
            wall = time.time() - time.perf_counter()
            last, elapsed = rows[-1], 0.0
            for row in rows:
                step, end, seconds, wait, loss, gn, scale, lr, probe = row
                rec = self._open_record(step, wall + end, seconds, wait)
                rec.probe_seconds = probe
                rec.learning_rate = lr if type(lr) is float else _learning_rate(lr)
                elapsed += seconds
                if read_memory and row is last:
                    self.read_memory(step, end)
                if self.on_cpu:
                    self._absorb_values(rec, step, loss, gn, scale)
            # the next batch covers about readback_lag_seconds of steps
            if self._batch_steps and elapsed > 0:
                self._batch = max(1, min(dv.ROWS, int(self.config.readback_lag_seconds * len(rows) / elapsed)))
        if self.compute_clock is not None:
            self.totals.compute = self.compute_clock.collect()
        if not self.on_cpu:
            self._flush()
            self._absorb(self._readback.poll())

    def _absorb_values(self, rec: StepRecord | None, step: int, loss: float, raw_gn: float, scale: float) -> None:
        """Fold one step's values in."""
        gn = None if raw_gn == dv.ABSENT else raw_gn
        t = self.totals
        t.nonfinite_loss += not math.isfinite(loss)
        t.nonfinite_grad += gn is not None and not math.isfinite(gn)
        tripped = self.guards.check_step(step, loss, gn, self.history)
        if tripped:
            self.trip(tripped)
        gn_value = math.nan if gn is None else gn
        if rec is not None:
            rec.loss, rec.grad_norm = loss, gn_value
        self.latest.loss, self.latest.grad_norm = loss, gn_value
        if gn_value > 0 and abs(gn_value - self._same_norm) <= 1e-5 * gn_value:
            self._watch_clipped(gn_value)
        else:
            self._same_norm, self._same_norm_steps = gn_value, 1
        if self.scaler is not None:
            if scale < self._last_scale:
                t.amp_skipped += 1
            self._last_scale = self.latest.loss_scale = scale

    def _watch_clipped(self, norm: float) -> None:
        """A grad norm that reads the same value (to 1e-5) step after step is the clipped one: ``step()`` was called
        after ``clip_grad_norm_`` without ``grad_norm=``. Then GradNormExplosion can never fire: say so, once."""
        self._same_norm_steps += 1
        if self._same_norm_steps == CLIPPED_NORM_STEPS and not self._warned_clipped:
            self._warned_clipped = True
            log.warning("trainpatrol: the grad norm read %.6g on %d steps in a row: it looks clipped (patrol.step() "
                        "after clip_grad_norm_ reads the clipped gradients). Pass grad_norm=<the total "
                        "clip_grad_norm_ returns>, or call patrol.step() before clipping, so a blow-up shows.",
                        norm, CLIPPED_NORM_STEPS)
