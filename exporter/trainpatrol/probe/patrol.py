"""Patrol: the training-side module that runs in every rank.

The hot path (``step``) keeps loss, grad norm and non-finite counts on the device and reads them one
step later from pinned memory; it never synchronises host and device. On CPU it reads them at once,
and folds them into history, totals and guards every few steps in one loop (a non-finite value at
once). Control actions happen at step boundaries, agreed across ranks: before each batch when batches
come through ``loader`` (the only place where a checkpoint holds the loader's position, for an exact
resume), else right after ``optimizer.step()``. A non-finite step's update is skipped (``update_hooks``).
Emits every rank metric of the catalogue through its agent (see docs/metrics.md).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import torch

from ..catalogue import STEP_DURATION_BUCKETS
from ..control.checkpoint import Checkpointer, Restored, SaveFn
from ..control.coordinator import Coordinator, encode
from ..control.evidence import bundle_name, set_recording, write_manifest, write_rank_part
from ..control.executor import Executor
from ..protocol import ActionRecord
from ..report import write_report_quietly
from . import device_values as dv
from .config import PatrolConfig
from .embedded import agent_answers, is_loopback_url, start_embedded_agent, wait_for_agent
from .guards import Guards
from .host_memory import HostMemory, worker_pids
from .identity import detect
from .loader import LoaderAudit, LoaderTracker, TimedLoader, audit
from .memory import MemoryReading, default_reader
from .metrics_state import Latest, Totals, samples
from .publisher import Publisher
from .readback import Readback
from .run_key import run_key
from .update_hooks import UpdateHooks
from .window import History, StepRecord
from .workload import detect as detect_workload

log = logging.getLogger("trainpatrol")
T = TypeVar("T")
_JUDGED_AT_ONCE = {"nonfinite_loss", "nonfinite_grad", "memory_fragmentation", "oom_risk", "host_memory_leak"}
"""Guards whose action never waits for a CPU batch (see ``step``, ``_read_memory``)."""
CLIPPED_NORM_STEPS = 8
"""Steps in a row with the same grad norm (to 1e-5) that mean it was read after clipping."""


class Patrol:
    """``with Patrol(run="demo", model=model, optimizer=opt) as patrol:`` then, per batch,
    ``patrol.step(loss)`` after ``backward()``; iterate batches through ``patrol.loader(...)``."""

    def __init__(self, run: str | None = None, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, *, scheduler: Any = None, scaler: Any = None,
                 device: torch.device | str | None = None, config: PatrolConfig | None = None,
                 extra_state: Callable[[], dict[str, Any]] | None = None,
                 load_extra_state: Callable[[dict[str, Any]], None] | None = None,
                 save_fn: SaveFn | None = None, **overrides: Any) -> None:
        cfg = replace(config or PatrolConfig(), **overrides)
        if run is not None:
            cfg.run = run
        self.config = cfg.validate()
        self._hooks: UpdateHooks | None = None
        self._boundary_driven = self._framework = False
        """Whether the caller runs ``boundary()`` (the loader wrapper, a framework callback, a loop of its own);
        until then Patrol acts from its hook after ``optimizer.step()``."""
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.extra_state, self.load_extra_state = extra_state, load_extra_state
        if device is None and model is not None:
            first = next(model.parameters(), None)
            device = first.device if first is not None else None
        self.identity = detect(torch.device(device) if device is not None else None)
        self.device = self.identity.device
        self.workload = detect_workload()
        self._params = list(model.parameters()) if model is not None else []
        self.history = History(cfg.window)
        self.totals = Totals()
        self.latest = Latest()
        self.guards = Guards(cfg.guards)
        self._values = dv.DeviceValues(self.device)
        self._readback = Readback(self.device, dv.WIDTH)
        self._flush_every = 1
        self._on_cpu = self.device.type == "cpu"
        self._rows: list[list[Any]] = []
        """On CPU, steps not yet folded in: [step, end, seconds, loader wait, loss, grad norm, scale,
        learning rate, probe seconds] (see ``_absorb_host``)."""
        self._host_batch = 1
        self._batch_steps = not cfg.guard_actions.keys() - _JUDGED_AT_ONCE
        """Whether CPU steps may wait in a batch: not when a guard judged there may act, as its action
        must come at the next boundary (non-finite values and memory readings are judged at once)."""
        self._owner = threading.get_ident()
        self._memory_reader = cfg.memory_reader or default_reader(self.device)
        self._memory_due = -math.inf if self._memory_reader is not None else math.inf
        self._lrs: list[Any] | None = None
        """The last step's param-group learning rates, until ``latest`` takes them."""
        self._audit: LoaderAudit | None = None
        self.loader_tracker = LoaderTracker()
        self.host_memory = HostMemory(cfg.host_memory_limit_bytes)
        self._best_val = math.inf
        self.validation_history: deque[dict[str, float]] = deque(maxlen=256)
        self.best_pending: float | None = None
        """A new best validation loss that the next checkpoint is marked with (see ``evaluate``)."""
        self._audit_logged: set[str] = set()
        self._loss_sum: torch.Tensor | None = None
        self._wait_since_step = 0.0
        self._probe_since_step = 0.0
        self._last_step_end = time.perf_counter()
        self._last_scale = math.nan
        self._same_norm, self._same_norm_steps, self._warned_clipped = math.nan, 0, False
        self.state = "running"
        self.actions: deque[ActionRecord] = deque(maxlen=32)
        self.last_checkpoint = ""
        self.last_evidence = ""
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, Any]] = {}
        self._done: deque[int] = deque(maxlen=512)
        self._seq = 0
        self._started = time.time()
        self._instance = secrets.token_hex(8)
        self.checkpointer = Checkpointer(cfg.checkpoint_dir, keep_last=cfg.keep_checkpoints, save_fn=save_fn)
        self.coordinator = Coordinator(self.device, target_seconds=cfg.control_target_seconds)
        self.executor = Executor(self)
        if cfg.record_memory_history:
            set_recording(True)
        if cfg.embedded_agent and not agent_answers(cfg.agent_url):
            # both wait for /healthz, so the first push finds the agent; it outlives this run (probe/embedded.py)
            if self.identity.local_rank == 0:
                start_embedded_agent(cfg.agent_url, idle_seconds=cfg.embedded_agent_idle_seconds)
            elif is_loopback_url(cfg.agent_url) and not wait_for_agent(cfg.agent_url):
                log.warning("trainpatrol: no agent answers at %s, and local rank 0 started none; pushes will retry",
                            cfg.agent_url)
        self.publisher = Publisher(cfg.agent_url, self.snapshot, self._on_commands, token=cfg.token,
                                   run_key=run_key(cfg.run_key, self.coordinator.distributed, self.device),
                                   interval=cfg.push_interval_seconds)
        self.publisher.start()

    # --- the loop -----------------------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Setting it (also after construction) hooks its steps: the non-finite skip and acting after the step."""
        if self._hooks is not None:
            self._hooks.remove()
        self._optimizer = optimizer
        self._hooks = None if optimizer is None else \
            UpdateHooks(optimizer, skip=self.config.skip_nonfinite_updates, after_step=self._after_optimizer_step)
        if self._hooks is not None and self._framework:
            self._hooks.judge_from_grads = True

    @property
    def step_count(self) -> int:
        """Optimizer steps completed (restored by ``restore``)."""
        return self.totals.steps

    def loader(self, loader: Iterable[T]) -> TimedLoader[T]:
        """Wrap a batch iterable: times each wait and runs ``boundary()`` before each fetch."""
        self._audit = audit(loader, self.device.type == "cuda")
        for check, advice in (self._audit.warnings if self._audit else {}).items():
            if check not in self._audit_logged:
                self._audit_logged.add(check)
                log.warning("trainpatrol DataLoader audit: %s: %s", check, advice)
        return TimedLoader(loader, self.boundary, self.waited, self.loader_tracker)

    def waited(self, seconds: float) -> None:
        """Report time spent waiting for a batch (done by ``loader``; for frameworks that fetch themselves)."""
        self._wait_since_step += seconds
        self.totals.loader_wait += seconds

    def start_at(self, step: int) -> None:
        """Continue counting from ``step`` (a resumed run); ``restore`` does this itself."""
        self._absorb_host()
        self.totals.steps = step
        self.totals.micro_steps = step * self.config.grad_accum_steps
        self.coordinator.next_exchange = step + self.coordinator.interval
        self._last_step_end = time.perf_counter()

    def step(self, loss: torch.Tensor, *, grad_norm: torch.Tensor | float | None = None,
             batch_size: int | None = None, tokens: int | None = None,
             learning_rates: list[float] | None = None) -> None:
        """Record one micro-step; every ``grad_accum_steps``-th call closes an optimizer step.

        Call after ``backward()`` and before ``optimizer.step()``/``zero_grad()``. Pass the total
        returned by ``clip_grad_norm_`` as ``grad_norm`` to reuse it.
        """
        start = time.perf_counter()
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
                self._probe_since_step += time.perf_counter() - start
                return
            mean_loss, self._loss_sum = self._loss_sum / accum, None
        else:
            mean_loss = loss
        if grad_norm is None and self._params:
            grad_norm = dv.total_grad_norm(self._params)
        scale = None
        if self.scaler is not None and getattr(self.scaler, "is_enabled", lambda: False)():
            scale = getattr(self.scaler, "_scale", None)
        t.steps += 1
        if learning_rates is not None:
            self.latest.learning_rates, self._lrs = list(learning_rates), None
        elif self.optimizer is not None:
            lrs: list[Any] = []  # a plain loop is the cheapest way in situ; _take_lrs filters
            for group in self.optimizer.param_groups:
                lrs.append(group.get("lr"))
            self._lrs = lrs
        if not self._on_cpu:
            rec = self._step_device(mean_loss, grad_norm, scale)
            if self.latest.learning_rates:
                rec.learning_rate = self.latest.learning_rates[0]
            rec.probe_seconds = self._probe_since_step + (time.perf_counter() - start)
            self._probe_since_step = 0.0
            return
        # on CPU a value is read for free (item(): no detach, no warning); the row is folded in later
        loss_f = float(mean_loss.item())
        gn_f = dv.ABSENT if grad_norm is None else \
            float(grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm)
        lr = learning_rates[0] if learning_rates else self._lrs[0] if self._lrs else math.nan
        row = [t.steps, start, start - self._last_step_end, self._wait_since_step, loss_f, gn_f,
               1.0 if scale is None else float(scale.item() if isinstance(scale, torch.Tensor) else scale),
               float(lr) if isinstance(lr, float | int | torch.Tensor) else math.nan, 0.0]
        self._last_step_end = start
        self._wait_since_step = 0.0
        rows = self._rows
        if not rows:
            self._owner = threading.get_ident()
        rows.append(row)
        both = loss_f + gn_f
        if self._hooks is not None:
            self._hooks.judge(both - both != 0)  # NaN/Inf in either; an absent norm is a finite -1
        # a non-finite value is folded in at once, so a guard's action comes at the next boundary
        if len(rows) >= self._host_batch or both - both != 0 or start >= self._memory_due:
            self._absorb_host(start >= self._memory_due)
            self.history.records[-1].probe_seconds = self._probe_since_step + (time.perf_counter() - start)
        else:
            row[-1] = self._probe_since_step + (time.perf_counter() - start)
        self._probe_since_step = 0.0
        if self._pending and self._hooks is None and not self._boundary_driven:
            self._cannot_act()

    def _cannot_act(self) -> None:
        action = next(iter(self.take_pending().values()))
        raise RuntimeError(f"trainpatrol: `{action['action']}` was requested ({action['reason']}), but this loop has "
                           "no "
                           "step boundary where Patrol can act: iterate batches through `patrol.loader(...)`, pass "
                           "`optimizer=` to Patrol, or call `patrol.boundary()` between steps.")

    def _step_device(self, mean_loss: torch.Tensor, grad_norm: torch.Tensor | float | None,
                     scale: torch.Tensor | None) -> StepRecord:
        """One step's values into the device ring; its record is made now, its values read back later."""
        t = self.totals
        self._values.record(mean_loss, grad_norm, scale)
        if self._hooks is not None and self._hooks.mode != "off":  # the row just written holds loss and grad norm
            self._hooks.judge(self._values.nonfinite())
        now = time.perf_counter()
        rec = self.history.record(t.steps, time.time())
        rec.step_seconds = now - self._last_step_end
        rec.loader_wait_seconds = self._wait_since_step
        t.observe_step(rec.step_seconds)
        self._last_step_end = now
        self._wait_since_step = 0.0
        self._take_lrs()
        if now >= self._memory_due:
            self._read_memory(rec.step, now)
        if self._values.filled >= self._flush_every:
            self._flush()
        self._absorb(self._readback.poll())
        return rec

    def _take_lrs(self) -> None:
        """The last step's param-group learning rates, as read, into ``latest``."""
        if self._lrs is not None:
            self.latest.learning_rates = [float(v) for v in self._lrs if isinstance(v, (float, int))]
            self._lrs = None

    def _read_memory(self, step: int, now: float | None = None) -> None:
        """Read the allocator into ``step``'s record; ``now``: a timed read, the next one due an interval later."""
        assert self._memory_reader is not None
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
        self._trip(self.guards.check_memory(m))

    def _flush(self) -> None:
        """Send the filled rows to the host; on CUDA, size the next batch to about ``readback_lag``."""
        if not self._values.filled:
            return
        rows, buf = self._values.flush()
        self._readback.submit((self.totals.steps - rows + 1, rows), buf)
        if self.device.type == "cuda":
            recent = self.history.median("step_seconds", 8)
            lag = self.config.readback_lag_seconds
            self._flush_every = max(1, min(dv.ROWS, int(lag / recent) if recent > 0 else 1))

    def _absorb(self, values: list[tuple[tuple[int, int], list[float]]]) -> None:
        """Fold read-back device values (late by a step or a few) into history, totals and guards."""
        for (first, rows), v in values:
            for step, loss, raw_gn, scale in dv.unpack(first, rows, v):
                self._absorb_values(self.history.get(step), step, loss, raw_gn, scale)

    def _absorb_host(self, read_memory: bool = False) -> None:
        """Fold the pending CPU rows into history, totals and guards in step order, each as ``_step_device``
        and ``_absorb_values`` would (``read_memory``: an allocator read at the last row). One loop every
        few steps costs less than its body each step: after backward() every line runs several times slower."""
        rows = self._rows
        if not rows:
            return
        self._rows = []
        self._take_lrs()
        wall = time.time() - time.perf_counter()
        history, t, guards = self.history, self.totals, self.guards
        add, check, nan, absent = history.add, guards.check_step, math.nan, dv.ABSENT
        hist, step_sum, buckets = t.step_hist, t.step_sum, STEP_DURATION_BUCKETS
        scaler, last, elapsed = self.scaler, rows[-1], 0.0
        for row in rows:
            step, end, seconds, wait, loss, gn, scale, lr, probe = row
            rec = StepRecord(step, wall + end, nan, nan, seconds, wait, nan, nan, nan, probe, lr)
            add(rec)
            hist[bisect_left(buckets, seconds)] += 1
            step_sum += seconds
            elapsed += seconds
            if read_memory and row is last:
                self._read_memory(step, end)
            both = loss + gn
            if both - both != 0:  # rare: a non-finite row is folded in at once (see step)
                t.nonfinite_loss += not math.isfinite(loss)
                t.nonfinite_grad += gn != absent and not math.isfinite(gn)
            tripped = check(step, loss, None if gn == absent else gn, history)
            if tripped:
                self._trip(tripped)
            rec.loss = loss
            rec.grad_norm = nan if gn == absent else gn
            if gn > 0 and abs(gn - self._same_norm) <= 1e-5 * gn:  # rare: see _watch_clipped
                self._watch_clipped(gn)
            else:
                self._same_norm, self._same_norm_steps = gn, 1
            if scaler is not None:
                if scale < self._last_scale:
                    t.amp_skipped += 1
                self._last_scale = self.latest.loss_scale = scale
        t.step_sum = step_sum
        self.latest.loss, self.latest.grad_norm = rec.loss, rec.grad_norm
        # the next batch covers about readback_lag_seconds of steps
        if self._batch_steps and elapsed > 0:
            self._host_batch = max(1, min(dv.ROWS, int(self.config.readback_lag_seconds * len(rows) / elapsed)))

    def _absorb_values(self, rec: StepRecord | None, step: int, loss: float, raw_gn: float, scale: float) -> None:
        """Fold one read-back step's values in (``_absorb_host`` does the same, inline)."""
        gn = None if raw_gn == dv.ABSENT else raw_gn
        t = self.totals
        t.nonfinite_loss += not math.isfinite(loss)
        t.nonfinite_grad += gn is not None and not math.isfinite(gn)
        tripped = self.guards.check_step(step, loss, gn, self.history)
        if tripped:
            self._trip(tripped)
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

    def _trip(self, tripped: list[tuple[str, str]]) -> None:
        for guard, detail in tripped:
            action = self.config.guard_actions.get(guard)
            if action:
                self.request(action, f"local guard {guard}: {detail}", source=f"guard:{guard}")

    def evaluate(self, val_loss: float | torch.Tensor) -> None:
        """Record a validation loss (evaluation is off the hot path, so a tensor is read here). A new best one
        is checkpointed at the next boundary, and that checkpoint is kept (``keep_best_checkpoint``)."""
        self._absorb_host()
        value = float(val_loss)
        self.latest.validation_loss = value
        self.validation_history.append({"step": self.totals.steps, "value": value, "time": time.time()})
        if self.config.keep_best_checkpoint and value < self._best_val:
            self._best_val = self.best_pending = value
            self.request("checkpoint", f"new best validation loss {value:.6g}", source="best_validation_loss")

    def restored_best(self, value: float) -> None:
        """The best validation loss of the run this one restores (a later one must beat it)."""
        self._best_val = min(self._best_val, value)

    # --- control ------------------------------------------------------------------------------
    def request(self, action: str, reason: str = "", source: str = "local", command_id: int | None = None,
                alert: dict[str, Any] | None = None) -> int:
        """Ask for an action at the next agreed boundary (what guards and the agent's commands do)."""
        cid = command_id or secrets.randbelow(2**31 - 2) + 1
        with self._lock:
            if cid in self._done or action in self._pending:
                return cid
            self._pending[action] = {"id": cid, "action": action, "reason": reason, "source": source,
                                     "alert": alert}
        self.publisher.wake()
        return cid

    def _on_commands(self, commands: list[dict[str, Any]]) -> None:
        for c in commands:
            # a command queued before this process started was meant for an earlier incarnation
            # of the run (e.g. the stop that ended the job this one restores from)
            if c.get("run") == self.config.run and float(c.get("created", 0)) >= self._started:
                self.request(c["action"], c.get("reason", ""), c.get("source", "agent"), int(c["id"]),
                             c.get("alert"))

    def take_pending(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return dict(self._pending)

    def mark_done(self, ids: Iterable[int]) -> None:
        with self._lock:
            for cid in ids:
                self._done.append(cid)
                for action, c in list(self._pending.items()):
                    if c["id"] == cid:
                        del self._pending[action]

    def control_word(self) -> list[int]:
        pending = {a: c["id"] for a, c in self.take_pending().items()}
        return encode(pending, self.history.median("step_seconds", 20) if self.history.records else 0.0,
                      time.time())

    def boundary(self) -> None:
        """The step boundary: exchange the control word when due and carry out agreed actions. Called by
        ``loader`` before each batch; a loop or framework that calls it itself takes over from the hook
        after ``optimizer.step()``."""
        self._boundary_driven = True
        self._boundary()

    def framework_drives(self) -> None:
        """A framework callback feeds this Patrol after each optimizer step and runs ``boundary()`` itself:
        Patrol stops acting from its optimizer hook, and judges each update from the gradients before it."""
        self._boundary_driven = self._framework = True
        if self._hooks is not None:
            self._hooks.judge_from_grads = True

    def judge_update(self, grad_norm: torch.Tensor | None) -> None:
        """For frameworks whose ``optimizer.step()`` runs a closure (forward and backward) before updating:
        call after backward, inside the step; a non-finite ``grad_norm`` skips this update."""
        if self._hooks is not None and grad_norm is not None:
            self._hooks.decide(self._hooks.flag(grad_norm))

    def _after_optimizer_step(self) -> None:
        if not self._boundary_driven:
            self._boundary()

    def _boundary(self) -> None:
        if not self._pending and not self.coordinator.distributed:
            return
        if self.totals.micro_steps % self.config.grad_accum_steps:
            return
        start = time.perf_counter()
        step = self.totals.steps
        if not self.coordinator.due(step):
            return
        self._absorb_host()  # the control word carries the recent step time
        agreed = self.coordinator.exchange(step, self.control_word())
        self.latest.interval_steps = self.coordinator.interval
        self._probe_since_step += time.perf_counter() - start
        if agreed is not None and agreed.commands:
            self._flush()
            self._absorb(self._readback.drain())
            self.executor.execute(agreed)
            self._last_step_end = time.perf_counter()

    # --- state out ----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The push payload (see trainpatrol.protocol.RankSnapshot). From the training thread it holds
        every step so far; from the publisher's, CPU values may be ``readback_lag_seconds`` late, as on CUDA."""
        if self._rows and threading.get_ident() == self._owner:
            self._absorb_host()
        self._read_host_memory()
        self._seq += 1
        ident = self.identity
        return {
            "run": self.config.run, "rank": ident.rank, "instance": self._instance, "local_rank": ident.local_rank,
            "world_size": ident.world_size, "host": ident.host, "pid": os.getpid(), "gpu_uuid": ident.gpu_uuid,
            **self.workload.fields(),
            "seq": self._seq, "time": time.time(), "step": self.totals.steps, "state": self.state,
            "samples": samples(self.totals, self.latest, self.history, self.guards.trips, self.guards.active,
                               self.state, ident.info_labels(self.workload), self._audit, self.publisher.dropped),
            "histogram": {"counts": _cumulative(self.totals.step_hist), "sum": self.totals.step_sum},
            "actions": [a.model_dump() for a in self.actions],
            "done_commands": list(self._done),
            "last_checkpoint": self.last_checkpoint, "evidence_dir": self.last_evidence,
        }

    def _read_host_memory(self) -> None:
        """The rank's and its loader workers' resident sets, judged by the host_memory_leak guard. Read here, as
        a push is built (on the publisher thread), never in ``step``; a tripped guard's action is a request,
        carried out by the training thread at its next boundary."""
        reading = self.host_memory.read(worker_pids(self.loader_tracker.iterator()))
        if reading is not None:
            self.latest.host_memory = reading
            self._trip(self.guards.check_host_memory(reading))

    def config_dict(self) -> dict[str, Any]:
        d = asdict(self.config)
        d.pop("token", None)
        d.pop("run_key", None)  # evidence bundles and checkpoints carry this dict
        d["memory_reader"] = repr(self.config.memory_reader)
        return d

    # --- restore, close, OOM forensics --------------------------------------------------------
    def restore(self, path: str | Path = "latest") -> Restored:
        """Load model, optimizer, scheduler, scaler, RNG, the loader's position and extra state.

        ``"latest"`` is the newest checkpoint whose state is finite. Returns what was restored and why (false
        when there is nothing to restore: a fresh run)."""
        self._absorb_host()
        return self.executor.restore(path)

    def close(self) -> None:
        if self.state == "closed":
            return
        self._absorb_host()
        self._flush()
        self._absorb(self._readback.drain())
        if self.state not in ("stopped",):
            self.state = "closed"
        self.publisher.stop(final_push=True)
        if self._hooks is not None:
            self._hooks.remove()

    def __enter__(self) -> Patrol:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if isinstance(exc, torch.OutOfMemoryError):
            self.oom_forensics(exc)
        self.close()

    def oom_forensics(self, exc: BaseException) -> Path:
        """Write an evidence directory for an OOM and push a final snapshot; the caller re-raises."""
        self._absorb_host()
        self._flush()
        self._absorb(self._readback.poll())
        if self._memory_reader is not None:
            self._read_memory(self.totals.steps)
        bundle = Path(self.config.evidence_dir) / bundle_name(time.time(), self.totals.steps, "oom")
        write_rank_part(bundle, self.identity.rank, history=self.history.dump(), device=self.device,
                        nvml={"available": False, "reason": "not fetched during OOM handling"},
                        config=self.config_dict(), extra={"error": repr(exc)})
        write_manifest(bundle, {"action": "oom", "step": self.totals.steps, "rank": self.identity.rank},
                       {"source": "exception", "error": repr(exc)})
        write_report_quietly(bundle)
        self.last_evidence = str(bundle)
        self.publisher.push_now()
        log.error("trainpatrol: out of memory at step %d; evidence in %s", self.totals.steps, bundle)
        return bundle

    def memory_reading(self) -> MemoryReading | None:
        return self.latest.memory


def _cumulative(counts: list[float]) -> list[float]:
    out, acc = [], 0.0
    for c in counts:
        acc += c
        out.append(acc)
    return out
