"""Patrol: the training-side module that runs in every rank, and the public face of its parts: the step
recorder (the hot path, no host-device sync), the control loop (actions at step boundaries, agreed across
ranks) and reporting (the pushes). A non-finite step's update is skipped (``update_hooks``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import torch

from ..control.checkpoint import Checkpointer, Restored, SaveFn
from ..control.evidence import fetch_nvml, set_recording
from ..control.evidence_writer import EvidenceWriter
from ..control.run_record import RunRecord
from ..control.training_state import STATEFUL, TrainingState
from ..protocol import ActionRecord
from .config import PatrolConfig
from .control_loop import ControlLoop
from .embedded import ensure_agent
from .guards import Guards
from .host_memory import HostMemory
from .identity import detect
from .loader import LoaderTracker, TimedLoader
from .memory import MemoryReading
from .metrics_state import Latest, Totals
from .publisher import Publisher
from .reporting import Reporting, config_dict
from .run_key import run_key
from .step_recorder import StepRecorder
from .update_hooks import UpdateHooks
from .window import History
from .workload import detect as detect_workload

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
        if device is None and model is not None:
            first = next(model.parameters(), None)
            device = first.device if first is not None else None
        self.identity = detect(torch.device(device) if device is not None else None)
        self.device = self.identity.device
        self.workload = detect_workload()
        self.history, self.totals, self.latest = History(cfg.window), Totals(), Latest()
        self.guards = Guards(cfg.guards)
        self.recorder = StepRecorder(cfg, self.device, self.history, self.totals, self.latest, self.guards,
                                     lambda tripped: self.control.trip(tripped),
                                     list(model.parameters()) if model is not None else [])
        self._hooks: UpdateHooks | None = None
        self._framework = False
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.loader_tracker = LoaderTracker()
        self.host_memory = HostMemory(cfg.host_memory_limit_bytes)
        self._best_val = math.inf
        self.validation_history: deque[dict[str, float]] = deque(maxlen=256)
        self.record = RunRecord()
        self.checkpointer = Checkpointer(cfg.checkpoint_dir, keep_last=cfg.keep_checkpoints, save_fn=save_fn)
        self.training = TrainingState(lambda: {name: getattr(self, name) for name in STATEFUL}, self.loader_tracker,
                                      extra_state, load_extra_state)
        self.evidence = EvidenceWriter(cfg.evidence_dir, self.identity.rank, self.device,
                                       history=self.history.dump, config=self.config_dict,
                                       nvml=lambda: fetch_nvml(cfg.agent_url, cfg.token))
        self.control = ControlLoop(cfg, self.identity, self.recorder, record=self.record,
                                   checkpointer=self.checkpointer, evidence=self.evidence, training=self.training,
                                   wake=lambda: self.publisher.wake(), announce=lambda: self.publisher.push_now(),
                                   context=lambda: self.reporting.evidence_context(), rearm_guards=self.guards.rearm)
        self.commands, self.coordinator, self.executor = \
            self.control.commands, self.control.coordinator, self.control.executor
        self.reporting = Reporting(cfg, self.identity, self.workload, self.recorder, self.guards, self.record,
                                   self.host_memory, self.loader_tracker, self.commands.done, self.validation_history)
        if cfg.record_memory_history:
            set_recording(True)
        if cfg.embedded_agent:
            ensure_agent(cfg.agent_url, self.identity.local_rank, cfg.embedded_agent_idle_seconds)
        self.publisher = Publisher(cfg.agent_url, self.reporting.snapshot, self.commands.from_agent, token=cfg.token,
                                   run_key=run_key(cfg.run_key, self.coordinator.distributed, self.device),
                                   interval=cfg.push_interval_seconds)
        self.reporting.dropped = lambda: self.publisher.dropped
        self.publisher.start()

    # --- what the executor records --------------------------------------------------------------
    @property
    def state(self) -> str:
        return self.record.state

    @property
    def actions(self) -> deque[ActionRecord]:
        return self.record.actions

    @property
    def last_checkpoint(self) -> str:
        return self.record.last_checkpoint

    @property
    def last_evidence(self) -> str:
        return self.record.last_evidence

    @property
    def extra_state(self) -> Callable[[], dict[str, Any]] | None:
        return self.training.extra_state

    @extra_state.setter
    def extra_state(self, extra_state: Callable[[], dict[str, Any]] | None) -> None:
        self.training.extra_state = extra_state

    @property
    def load_extra_state(self) -> Callable[[dict[str, Any]], None] | None:
        return self.training.load_extra_state

    @load_extra_state.setter
    def load_extra_state(self, load_extra_state: Callable[[dict[str, Any]], None] | None) -> None:
        self.training.load_extra_state = load_extra_state

    @property
    def best_pending(self) -> float | None:
        """A new best validation loss that the next checkpoint is marked with (see ``evaluate``)."""
        return self.training.best_pending

    # --- the loop -----------------------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.recorder.optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Setting it (also after construction) hooks its steps: the non-finite skip and acting after the step."""
        if self._hooks is not None:
            self._hooks.remove()
        self.recorder.optimizer = optimizer
        self._hooks = None if optimizer is None else \
            UpdateHooks(optimizer, skip=self.config.skip_nonfinite_updates, after_step=self._after_optimizer_step)
        if self._hooks is not None and self._framework:
            self._hooks.judge_from_grads = True
        self.recorder.hooks = self._hooks

    @property
    def scaler(self) -> Any:
        return self.recorder.scaler

    @scaler.setter
    def scaler(self, scaler: Any) -> None:
        self.recorder.scaler = scaler

    @property
    def step_count(self) -> int:
        """Optimizer steps completed (restored by ``restore``)."""
        return self.totals.steps

    def loader(self, loader: Iterable[T]) -> TimedLoader[T]:
        """Wrap a batch iterable: times each wait and runs ``boundary()`` before each fetch."""
        self.reporting.audit_loader(loader, self.device.type == "cuda")
        return TimedLoader(loader, self.boundary, self.waited, self.loader_tracker)

    def waited(self, seconds: float) -> None:
        """Report time spent waiting for a batch (done by ``loader``; for frameworks that fetch themselves)."""
        self.recorder.waited(seconds)

    def start_at(self, step: int) -> None:
        """Continue counting from ``step`` (a resumed run); ``restore`` does this itself."""
        self.recorder.start_at(step)
        self.coordinator.next_exchange = step + self.coordinator.interval

    def step(self, loss: torch.Tensor, *, grad_norm: torch.Tensor | float | None = None,
             batch_size: int | None = None, tokens: int | None = None,
             learning_rates: list[float] | None = None) -> None:
        """Record one micro-step; every ``grad_accum_steps``-th call closes an optimizer step.

        Call after ``backward()`` and before ``optimizer.step()``/``zero_grad()``. Pass the total
        returned by ``clip_grad_norm_`` as ``grad_norm`` to reuse it.
        """
        closed = self.recorder.record(loss, grad_norm, batch_size, tokens, learning_rates)
        # only a CPU step checks: a CUDA step keeps its cost to what it must do
        if closed and self.recorder.on_cpu and self.commands and self._hooks is None \
                and not self.control.boundary_driven:
            self.control.cannot_act()

    def evaluate(self, val_loss: float | torch.Tensor) -> None:
        """Record a validation loss (evaluation is off the hot path, so a tensor is read here). A new best one
        is checkpointed at the next boundary, and that checkpoint is kept (``keep_best_checkpoint``)."""
        self.recorder.absorb_host()
        value = float(val_loss)
        self.latest.validation_loss = value
        self.validation_history.append({"step": self.totals.steps, "value": value, "time": time.time()})
        if self.config.keep_best_checkpoint and value < self._best_val:
            self._best_val = self.training.best_pending = value
            self.request("checkpoint", f"new best validation loss {value:.6g}", source="best_validation_loss")

    def restored_best(self, value: float) -> None:
        """The best validation loss of the run this one restores (a later one must beat it)."""
        self._best_val = min(self._best_val, value)

    # --- control ------------------------------------------------------------------------------
    def request(self, action: str, reason: str = "", source: str = "local", command_id: int | None = None,
                alert: dict[str, Any] | None = None) -> int:
        """Ask for an action at the next agreed boundary (what guards and the agent's commands do)."""
        return self.commands.request(action, reason, source, command_id, alert)

    def control_word(self) -> list[int]:
        return self.control.control_word()

    def boundary(self) -> None:
        """The step boundary: exchange the control word when due and carry out agreed actions. Called by
        ``loader`` before each batch; a loop or framework that calls it itself takes over from the hook
        after ``optimizer.step()``."""
        self.control.boundary_driven = True
        self.control.boundary()

    def framework_drives(self) -> None:
        """A framework callback feeds this Patrol after each optimizer step and runs ``boundary()`` itself:
        Patrol stops acting from its optimizer hook, and judges each update from the gradients before it."""
        self.control.boundary_driven = self._framework = True
        if self._hooks is not None:
            self._hooks.judge_from_grads = True

    def judge_update(self, grad_norm: torch.Tensor | None) -> None:
        """For frameworks whose ``optimizer.step()`` runs a closure (forward and backward) before updating:
        call after backward, inside the step; a non-finite ``grad_norm`` skips this update."""
        if self._hooks is not None and grad_norm is not None:
            self._hooks.decide(self._hooks.flag(grad_norm))

    def _after_optimizer_step(self) -> None:
        if not self.control.boundary_driven:
            self.control.boundary()

    # --- state out ----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The push payload (see trainpatrol.protocol.RankSnapshot)."""
        return self.reporting.snapshot()

    def config_dict(self) -> dict[str, Any]:
        return config_dict(self.config)

    # --- restore, close, OOM forensics --------------------------------------------------------
    def restore(self, path: str | Path = "latest") -> Restored:
        """Load model, optimizer, scheduler, scaler, RNG, the loader's position and extra state.

        ``"latest"`` is the newest checkpoint whose state is finite. Returns what was restored and why (false
        when there is nothing to restore: a fresh run)."""
        self.recorder.absorb_host()
        restored = self.executor.restore(path)
        if restored:
            self.start_at(restored.step)
            best = self.executor.best_validation_loss()
            if best is not None:
                self.restored_best(best)
        return restored

    def close(self) -> None:
        if self.state == "closed":
            return
        self.recorder.catch_up(wait=True)
        if self.state not in ("stopped",):
            self.record.state = "closed"
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
        bundle = self.reporting.oom_evidence(self.evidence, exc)
        self.publisher.push_now()
        log.error("trainpatrol: out of memory at step %d; evidence in %s", self.totals.steps, bundle)
        return bundle

    def memory_reading(self) -> MemoryReading | None:
        return self.latest.memory
