"""Patrol: the training-side module that runs in every rank.

The hot path (``step``) keeps loss, grad norm and non-finite counts on the device and reads them one
step later from pinned memory; it never synchronises host and device. Control actions happen at
step boundaries (``boundary``, called by ``loader`` before each batch), agreed across ranks.
Emits every rank metric of the catalogue through its agent (see docs/metrics.md).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import torch

from ..control.checkpoint import Checkpointer, SaveFn
from ..control.coordinator import Coordinator, encode
from ..control.evidence import bundle_name, set_recording, write_manifest, write_rank_part
from ..control.executor import Executor
from ..protocol import ActionRecord
from ..report import write_report_quietly
from . import device_values as dv
from .config import PatrolConfig
from .embedded import agent_answers, start_embedded_agent, stop_embedded_agent
from .guards import Guards
from .identity import detect
from .loader import LoaderAudit, TimedLoader, audit
from .memory import MemoryReading, default_reader
from .metrics_state import Latest, Totals, samples
from .publisher import Publisher
from .readback import Readback
from .window import History

log = logging.getLogger("trainpatrol")
T = TypeVar("T")


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
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.extra_state, self.load_extra_state = extra_state, load_extra_state
        if device is None and model is not None:
            first = next(model.parameters(), None)
            device = first.device if first is not None else None
        self.identity = detect(torch.device(device) if device is not None else None)
        self.device = self.identity.device
        self._params = list(model.parameters()) if model is not None else []
        self.history = History(cfg.window)
        self.totals = Totals()
        self.latest = Latest()
        self.guards = Guards(cfg.guards)
        self._values = dv.DeviceValues(self.device)
        self._readback = Readback(self.device, dv.WIDTH)
        self._flush_every = 1
        self._memory_reader = cfg.memory_reader or default_reader(self.device)
        self._last_memory = -math.inf
        self._audit: LoaderAudit | None = None
        self._audit_logged: set[str] = set()
        self._loss_sum: torch.Tensor | None = None
        self._wait_since_step = 0.0
        self._probe_since_step = 0.0
        self._last_step_end = time.perf_counter()
        self._last_scale = math.nan
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
        self._agent_proc = None
        if cfg.embedded_agent and self.identity.local_rank == 0 and not agent_answers(cfg.agent_url):
            self._agent_proc = start_embedded_agent(cfg.agent_url)
        self.publisher = Publisher(cfg.agent_url, self.snapshot, self._on_commands, token=cfg.token,
                                   interval=cfg.push_interval_seconds)
        self.publisher.start()

    # --- the loop -----------------------------------------------------------------------------
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
        return TimedLoader(loader, self.boundary, self.waited)

    def waited(self, seconds: float) -> None:
        """Report time spent waiting for a batch (done by ``loader``; for frameworks that fetch themselves)."""
        self._wait_since_step += seconds
        self.totals.loader_wait += seconds

    def start_at(self, step: int) -> None:
        """Continue counting from ``step`` (a resumed run); ``restore`` does this itself."""
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
        t.samples += batch_size or 0
        t.tokens += tokens or 0
        detached = loss.detach()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        if t.micro_steps % self.config.grad_accum_steps:
            self._probe_since_step += time.perf_counter() - start
            return
        accum = self.config.grad_accum_steps
        mean_loss = self._loss_sum / accum if accum > 1 else self._loss_sum
        self._loss_sum = None
        if grad_norm is None and self._params:
            grad_norm = dv.total_grad_norm(self._params)
        scale = None
        if self.scaler is not None and getattr(self.scaler, "is_enabled", lambda: False)():
            scale = getattr(self.scaler, "_scale", None)
        t.steps += 1
        # a host tensor is read for free, so on CPU the values skip the device ring entirely
        on_host = mean_loss.device.type == "cpu" and self.device.type == "cpu"
        if not on_host:
            self._values.record(mean_loss, grad_norm, scale)
        now = time.perf_counter()
        rec = self.history.record(t.steps, time.time())
        rec.step_seconds = now - self._last_step_end
        rec.loader_wait_seconds = self._wait_since_step
        t.observe_step(rec.step_seconds)
        self._last_step_end = now
        self._wait_since_step = 0.0
        if learning_rates is not None:
            self.latest.learning_rates = list(learning_rates)
        elif self.optimizer is not None:
            self.latest.learning_rates = [float(g["lr"]) for g in self.optimizer.param_groups
                                          if isinstance(g.get("lr"), float | int)]
        if self._memory_reader is not None and now - self._last_memory >= self.config.memory_interval_seconds:
            self._last_memory = now
            self._read_memory(rec.step)
        if on_host:
            gn = dv.ABSENT if grad_norm is None else float(grad_norm)
            self._absorb_rows([(t.steps, float(mean_loss), gn, 1.0 if scale is None else float(scale))])
        elif self._values.filled >= self._flush_every:
            self._flush()
        self._absorb(self._readback.poll())
        rec.probe_seconds = self._probe_since_step + (time.perf_counter() - start)
        self._probe_since_step = 0.0

    def _read_memory(self, step: int) -> None:
        assert self._memory_reader is not None
        m = self._memory_reader()
        if m is None:
            return
        rec = self.history.get(step)
        if rec is not None:
            rec.allocated_bytes, rec.reserved_bytes = m.allocated, m.reserved
            rec.fragmentation_ratio = m.fragmentation
        prev = self.latest.memory
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
            self._absorb_rows(dv.unpack(first, rows, v))

    def _absorb_rows(self, rows: list[tuple[int, float, float, float]]) -> None:
        for step, loss, raw_gn, scale in rows:
            gn = None if raw_gn == dv.ABSENT else raw_gn
            self.totals.nonfinite_loss += not math.isfinite(loss)
            self.totals.nonfinite_grad += gn is not None and not math.isfinite(gn)
            self._trip(self.guards.check_step(step, loss, gn, self.history))
            rec = self.history.get(step)
            if rec is not None:
                rec.loss, rec.grad_norm = loss, math.nan if gn is None else gn
            self.latest.loss, self.latest.grad_norm = loss, math.nan if gn is None else gn
            if self.scaler is not None:
                if scale < self._last_scale:
                    self.totals.amp_skipped += 1
                self._last_scale = self.latest.loss_scale = scale

    def _trip(self, tripped: list[tuple[str, str]]) -> None:
        for guard, detail in tripped:
            action = self.config.guard_actions.get(guard)
            if action:
                self.request(action, f"local guard {guard}: {detail}", source=f"guard:{guard}")

    def evaluate(self, val_loss: float | torch.Tensor) -> None:
        """Record a validation loss (evaluation is off the hot path, so a tensor is read here)."""
        self.latest.validation_loss = float(val_loss)

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
        """The step boundary: exchange the control word when due and carry out agreed actions."""
        if self.totals.micro_steps % self.config.grad_accum_steps:
            return
        start = time.perf_counter()
        step = self.totals.steps
        if not self.coordinator.distributed and not self._pending:
            return
        if not self.coordinator.due(step):
            return
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
        """The push payload (see trainpatrol.protocol.RankSnapshot)."""
        self._seq += 1
        ident = self.identity
        return {
            "run": self.config.run, "rank": ident.rank, "instance": self._instance, "local_rank": ident.local_rank,
            "world_size": ident.world_size, "host": ident.host, "pid": os.getpid(), "gpu_uuid": ident.gpu_uuid,
            "seq": self._seq, "time": time.time(), "step": self.totals.steps, "state": self.state,
            "samples": samples(self.totals, self.latest, self.history, self.guards.trips, self.guards.active,
                               self.state, ident.info_labels(), self._audit, self.publisher.dropped),
            "histogram": {"counts": _cumulative(self.totals.step_hist), "sum": self.totals.step_sum},
            "actions": [a.model_dump() for a in self.actions],
            "done_commands": list(self._done),
            "last_checkpoint": self.last_checkpoint, "evidence_dir": self.last_evidence,
        }

    def config_dict(self) -> dict[str, Any]:
        d = asdict(self.config)
        d.pop("token", None)
        d["memory_reader"] = repr(self.config.memory_reader)
        return d

    # --- restore, close, OOM forensics --------------------------------------------------------
    def restore(self, path: str | Path = "latest") -> int:
        """Load model, optimizer, scheduler, scaler, RNG and extra state; returns the step."""
        return self.executor.restore(path)

    def close(self) -> None:
        if self.state == "closed":
            return
        self._flush()
        self._absorb(self._readback.drain())
        if self.state not in ("stopped",):
            self.state = "closed"
        self.publisher.stop(final_push=True)
        stop_embedded_agent(self._agent_proc)

    def __enter__(self) -> Patrol:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if isinstance(exc, torch.OutOfMemoryError):
            self.oom_forensics(exc)
        self.close()

    def oom_forensics(self, exc: BaseException) -> Path:
        """Write an evidence directory for an OOM and push a final snapshot; the caller re-raises."""
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
