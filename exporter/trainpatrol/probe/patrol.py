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
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import torch

from ..actions import ACTIONS
from ..control.checkpoint import Checkpointer, Restored, SaveFn
from ..control.commands import CommandBook
from ..control.coordinator import Coordinator
from ..control.evidence import fetch_nvml, set_recording
from ..control.evidence_writer import EvidenceWriter
from ..control.run_record import RunRecord
from ..control.training_state import STATEFUL, TrainingState
from ..protocol import ActionRecord
from .config import PatrolConfig
from .control_loop import ControlLoop, guard_trips
from .embedded import ensure_agent
from .guards import Guards
from .host_memory import HostMemory
from .identity import detect
from .loader import LoaderTracker, TimedLoader
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
        self._identity = identity = detect(torch.device(device) if device is not None else None)
        self._device = identity.device
        self._model, self._scheduler = model, scheduler
        self._hooks: UpdateHooks | None = None
        self._framework = False
        self._best_val = math.inf
        # what is recorded, and what reads it
        self._history, self._totals, self._latest = History(cfg.window), Totals(), Latest()
        self._guards = Guards(cfg.guards)
        self._record = RunRecord()
        self._loader_tracker = LoaderTracker()
        self._validation_history: deque[dict[str, float]] = deque(maxlen=256)
        # The one cycle: the publisher hands the agent's commands to the book, and a request wakes the
        # publisher at once; ``publisher`` is bound below, before anything can request.
        self._commands = CommandBook(cfg.run, time.time(), on_request=lambda: publisher.wake())
        self._coordinator = Coordinator(self._device, target_seconds=cfg.control_target_seconds)
        self._recorder = StepRecorder(cfg, self._device, self._history, self._totals, self._latest, self._guards,
                                      guard_trips(self._commands, cfg.guard_actions),
                                      list(model.parameters()) if model is not None else [])
        self._recorder.scaler = scaler
        self.optimizer = optimizer
        self._checkpointer = Checkpointer(cfg.checkpoint_dir, keep_last=cfg.keep_checkpoints, save_fn=save_fn)
        self._training = TrainingState(self._stateful, self._loader_tracker, extra_state, load_extra_state)
        self._evidence = EvidenceWriter(cfg.evidence_dir, identity.rank, self._device, history=self._history.dump,
                                        config=partial(config_dict, cfg),
                                        nvml=partial(fetch_nvml, cfg.agent_url, cfg.token))
        self._reporting = Reporting(cfg, identity, detect_workload(), self._recorder, self._guards, self._record,
                                    HostMemory(cfg.host_memory_limit_bytes), self._loader_tracker,
                                    self._commands.done, self._validation_history)
        self._publisher = publisher = Publisher(
            cfg.agent_url, self._reporting.snapshot, self._commands.from_agent, token=cfg.token,
            run_key=run_key(cfg.run_key, self._coordinator.distributed, self._device),
            interval=cfg.push_interval_seconds)
        self._reporting.dropped = lambda: publisher.dropped
        self._control = ControlLoop(cfg, identity, self._recorder, commands=self._commands,
                                    coordinator=self._coordinator, record=self._record,
                                    checkpointer=self._checkpointer, evidence=self._evidence, training=self._training,
                                    announce=publisher.push_now, context=self._reporting.evidence_context,
                                    rearm_guards=self._guards.rearm)
        if cfg.record_memory_history:
            set_recording(True)
        if cfg.embedded_agent:
            ensure_agent(cfg.agent_url, identity.local_rank, cfg.embedded_agent_idle_seconds)
        publisher.start()

    # --- what users read ------------------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._recorder.optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        # the hooks skip a non-finite update on the device and act after the step
        if self._hooks is not None:
            self._hooks.remove()
        self._recorder.optimizer = optimizer
        self._hooks = None if optimizer is None else \
            UpdateHooks(optimizer, skip=self.config.skip_nonfinite_updates, after_step=self._after_optimizer_step)
        if self._hooks is not None and self._framework:
            self._hooks.judge_from_grads = True
        self._recorder.hooks = self._hooks

    @property
    def step_count(self) -> int:
        return self._totals.steps

    @property
    def state(self) -> str:
        return self._record.state

    @property
    def actions(self) -> deque[ActionRecord]:
        return self._record.actions

    @property
    def last_checkpoint(self) -> str:
        return self._record.last_checkpoint

    @property
    def last_evidence(self) -> str:
        return self._record.last_evidence

    # --- the loop -----------------------------------------------------------------------------
    def loader(self, loader: Iterable[T]) -> TimedLoader[T]:
        """Wrap a batch iterable: times each wait and runs ``boundary()`` before each fetch."""
        self._reporting.audit_loader(loader, self._device.type == "cuda")
        return TimedLoader(loader, self.boundary, self._recorder.waited, self._loader_tracker)

    def step(self, loss: torch.Tensor, *, grad_norm: torch.Tensor | float | None = None,
             batch_size: int | None = None, tokens: int | None = None,
             learning_rates: list[float] | None = None) -> None:
        """Record one micro-step; every ``grad_accum_steps``-th call closes an optimizer step.

        Call after ``backward()`` and before ``optimizer.step()``/``zero_grad()``. Pass the total
        returned by ``clip_grad_norm_`` as ``grad_norm`` to reuse it.
        """
        closed = self._recorder.record(loss, grad_norm, batch_size, tokens, learning_rates)
        # only a CPU step checks: a CUDA step keeps its cost to what it must do
        if closed and self._recorder.on_cpu and self._commands and self._hooks is None \
                and not self._control.boundary_driven:
            self._control.cannot_act()

    def boundary(self) -> None:
        """The step boundary: exchange the control word when due and carry out agreed actions. Called by
        ``loader`` before each batch; a loop or framework that calls it itself takes over from the hook
        after ``optimizer.step()``."""
        self._control.boundary_driven = True
        self._control.boundary()

    def evaluate(self, val_loss: float | torch.Tensor) -> None:
        """Record a validation loss (evaluation is off the hot path, so a tensor is read here). A new best one
        is checkpointed at the next boundary, and that checkpoint is kept (``keep_best_checkpoint``)."""
        self._recorder.absorb_host()
        value = float(val_loss)
        self._latest.validation_loss = value
        self._validation_history.append({"step": self._totals.steps, "value": value, "time": time.time()})
        if self.config.keep_best_checkpoint and value < self._best_val:
            self._best_val = self._training.best_pending = value
            self.request("checkpoint", f"new best validation loss {value:.6g}", source="best_validation_loss")

    def restore(self, path: str | Path = "latest") -> Restored:
        """Load model, optimizer, scheduler, scaler, RNG, the loader's position and extra state.

        ``"latest"`` is the newest checkpoint whose state is finite. Returns what was restored and why (false
        when there is nothing to restore: a fresh run)."""
        self._recorder.absorb_host()
        restored = self._control.executor.restore(path)
        if restored:
            self._start_at(restored.step)
            best = self._control.executor.best_validation_loss()
            if best is not None:  # a later best must beat the restored run's
                self._best_val = min(self._best_val, best)
        return restored

    def request(self, action: str, reason: str = "", *, source: str = "local") -> int:
        """Ask for an action at the next agreed boundary (what guards and the agent's commands do)."""
        if action not in ACTIONS:
            raise ValueError(f"`Patrol.request({action!r})`: not an action; expected one of {', '.join(ACTIONS)}.")
        return self._commands.request(action, reason, source)

    def close(self) -> None:
        if self.state == "closed":
            return
        self._recorder.catch_up(wait=True)
        if self.state not in ("stopped",):
            self._record.state = "closed"
        self._publisher.stop(final_push=True)
        if self._hooks is not None:
            self._hooks.remove()

    def __enter__(self) -> Patrol:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if isinstance(exc, torch.OutOfMemoryError):
            self._oom_forensics(exc)
        self.close()

    # --- inside -------------------------------------------------------------------------------
    def _stateful(self) -> dict[str, Any]:
        return dict(zip(STATEFUL, (self._model, self.optimizer, self._scheduler, self._recorder.scaler), strict=True))

    def _start_at(self, step: int) -> None:
        self._recorder.start_at(step)
        self._coordinator.next_exchange = step + self._coordinator.interval

    def _after_optimizer_step(self) -> None:
        if not self._control.boundary_driven:
            self._control.boundary()

    def _oom_forensics(self, exc: BaseException) -> Path:
        """Write an evidence directory for an OOM and push a final snapshot; the caller re-raises."""
        bundle = self._reporting.oom_evidence(self._evidence, exc)
        self._publisher.push_now()
        log.error("trainpatrol: out of memory at step %d; evidence in %s", self._totals.steps, bundle)
        return bundle

    # --- framework hooks: only trainpatrol.integrations calls these ---------------------------
    def _attach(self, step: int, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                scheduler: Any) -> bool:
        """A framework callback takes over at its global ``step``: it fills in what this Patrol was built
        without, calls ``boundary()`` itself after each optimizer step, and each update is judged from the
        gradients before it. Returns whether the ranks agree through ``torch.distributed``."""
        self._model = self._model or model
        self._scheduler = self._scheduler or scheduler
        self._framework = self._control.boundary_driven = True
        self.optimizer = self.optimizer or optimizer  # hooked anew, judging from the gradients
        self._start_at(step)
        return self._coordinator.distributed

    def _waited(self, seconds: float) -> None:
        """Time the framework spent fetching a batch."""
        self._recorder.waited(seconds)

    def _judge_update(self, grad_norm: torch.Tensor | None) -> None:
        """For ``optimizer.step()`` that runs forward and backward in a closure before it updates: call after
        backward, inside the step; a non-finite ``grad_norm`` skips this update."""
        if self._hooks is not None and grad_norm is not None:
            self._hooks.decide(self._hooks.flag(grad_norm))

    def _framework_step(self, step: int, backward_passes: int, loss: torch.Tensor | None, **values: Any) -> None:
        """The framework's optimizer step ``step`` over ``backward_passes`` micro-batches; without a loss it is
        counted only. ``values``: ``step``'s keywords."""
        self._totals.steps = step - 1
        self._totals.micro_steps += max(0, backward_passes - 1)  # the last one is counted with the step
        if loss is None:
            self._totals.steps, self._totals.micro_steps = step, self._totals.micro_steps + 1
        else:
            self.step(loss, **values)
