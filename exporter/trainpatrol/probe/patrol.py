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
from ..control.checkpoint import STATEFUL, Checkpointer, Restored, TrainingState
from ..control.commands import CommandBook, RunRecord
from ..control.coordinator import Coordinator
from ..control.evidence import EvidenceWriter, fetch_nvml, set_recording
from ..protocol import ActionRecord
from . import fork_guard
from .collective_trace import enable_flight_recorder
from .compute_clock import ComputeClock
from .config import PatrolConfig
from .control_loop import ControlLoop, guard_trips
from .embedded import ensure_agent
from .flops import dtype_name
from .guards import Guards
from .host_memory import HostMemory
from .identity import detect
from .loader import LoaderTracker, TimedLoader
from .metrics_state import Latest, Totals
from .publisher import Publisher
from .run_key import run_key
from .snapshot import RankReport, config_dict
from .stall_watch import StallWatch
from .step_recorder import StepRecorder
from .update_hooks import UpdateHooks
from .window import History
from .workload import detect as detect_workload

log = logging.getLogger("trainpatrol")
T = TypeVar("T")

enable_flight_recorder()  # on import: torch sizes the trace when the user's init_process_group runs, after it


class Patrol:
    """Watches one training rank, pushes its health to the agent and carries out actions at step boundaries.

    Build one in every rank, after ``torch.distributed`` is initialised (the ranks agree on actions through
    it), and call ``step`` once per micro-batch. Patrol acts at the loop's step boundary: before each batch of
    ``loader``, else right after ``optimizer.step()``, else where the loop calls ``boundary``. Hugging Face and
    Lightning users take ``TrainPatrolCallback`` from ``trainpatrol.integrations`` instead.

    Args:
        run: The run's name: the ``run`` label of its series, and what ``trainpatrol pause RUN`` addresses.
            Overrides ``config.run``.
        model: Saved and restored by checkpoints; when ``step`` gets no ``grad_norm``, its gradients give one.
        optimizer: Saved and restored; its ``step()`` is hooked to skip a non-finite update, and to act
            after it when the loop neither uses ``loader`` nor calls ``boundary``.
        scheduler: A learning-rate scheduler (any object with ``state_dict``), saved and restored.
        scaler: A ``torch.amp.GradScaler``, saved and restored; its loss scale is exported.
        device: Where losses live. Default: the model's first parameter, else the current CUDA device, else CPU.
        config: Everything else (``PatrolConfig``). Default: ``PatrolConfig()``, filled from the environment.
        extra_state: Returns this rank's own state to checkpoint (counters, a sampler's offset).
        load_extra_state: Takes that state back in ``restore``.
        **overrides: ``PatrolConfig`` fields, set over ``config``.

    Raises:
        TypeError: An override that is not a ``PatrolConfig`` field.
        ValueError: A config value out of range; the message quotes it.

    Environment, read for what neither ``config`` nor ``overrides`` sets: ``TRAINPATROL_RUN``,
    ``TRAINPATROL_AGENT_URL`` (default http://127.0.0.1:9402; local rank 0 starts an agent there when none
    answers), ``TRAINPATROL_TOKEN`` or ``TRAINPATROL_TOKEN_FILE``, ``TRAINPATROL_RUN_KEY``,
    ``TRAINPATROL_CHECKPOINT_DIR``, ``TRAINPATROL_EVIDENCE_DIR``, ``TRAINPATROL_EMBEDDED_AGENT_IDLE_SECONDS``;
    ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` when ``torch.distributed`` is not initialised;
    ``LOCAL_WORLD_SIZE``; the pod's and launcher's identity (``probe/workload.py``).

    Attributes:
        config: The ``PatrolConfig`` in effect.
        optimizer: The hooked optimizer; assign one (or ``None``) to hook another.
        step_count: Optimizer steps completed, counting from the restored checkpoint's.
        state: ``running``, ``pausing``, ``paused``, ``stopping``, ``stopped`` or ``closed``.
        actions: The last 32 actions, oldest first: ``ActionRecord`` (action, outcome, step, detail, evidence).
        last_checkpoint: The directory of the last checkpoint written or restored; ``""`` before one.
        last_evidence: The directory of the last evidence bundle; ``""`` before one.

    Example::

        from trainpatrol import Patrol

        with Patrol(run="my-run", model=model, optimizer=opt) as patrol:  # rank/world from torch.distributed or env
            restored = patrol.restore("latest")  # false (restored.reason says why) when there is nothing to restore
            for epoch in range(restored.epoch, epochs):
                for batch in patrol.loader(train_loader):  # times loader waits; acts at step boundaries
                    loss = model(batch).loss; loss.backward()
                    patrol.step(loss)  # after backward, before opt.step(); grad_norm=clip_grad_norm_'s if you clip
                    opt.step(); opt.zero_grad()
    """

    def __init__(self, run: str | None = None, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, *, scheduler: Any = None, scaler: Any = None,
                 device: torch.device | str | None = None, config: PatrolConfig | None = None,
                 extra_state: Callable[[], dict[str, Any]] | None = None,
                 load_extra_state: Callable[[dict[str, Any]], None] | None = None, **overrides: Any) -> None:
        fork_guard.install()
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
        self._checkpointer = Checkpointer(cfg.checkpoint_dir, keep_last=cfg.keep_checkpoints,
                                          keep_pinned=cfg.keep_pinned_checkpoints)
        self._training = TrainingState(self._stateful, self._loader_tracker, extra_state, load_extra_state,
                                       checkpoint_format=cfg.checkpoint_format)
        self._evidence = EvidenceWriter(cfg.evidence_dir, identity.rank, self._device, history=self._history.dump,
                                        config=partial(config_dict, cfg),
                                        nvml=partial(fetch_nvml, cfg.agent_url, cfg.token))
        self._report = RankReport(cfg, identity, detect_workload(), self._recorder, self._guards, self._record,
                                    HostMemory(cfg.host_memory_limit_bytes), self._loader_tracker,
                                    self._commands.done, self._validation_history)
        self._publisher = publisher = Publisher(
            cfg.agent_url, self._report.snapshot, self._commands.from_agent, token=cfg.token,
            run_key=run_key(cfg.run_key, self._coordinator.distributed, self._device,
                            Path(cfg.checkpoint_dir) / f".run-key-{cfg.run}"),
            interval=cfg.push_interval_seconds)
        self._report.publisher = publisher
        self._control = ControlLoop(cfg, identity, self._recorder, commands=self._commands,
                                    coordinator=self._coordinator, record=self._record,
                                    checkpointer=self._checkpointer, evidence=self._evidence, training=self._training,
                                    announce=publisher.push_now, context=self._report.evidence_context,
                                    rearm_guards=self._guards.rearm)
        control = self._control
        self._report.stall_watch = StallWatch(
            self._recorder, self._record, self._commands, self._evidence, cfg.evidence_dir, identity.rank,
            identity.world_size,
            multiple=cfg.stall_step_multiple, floor_seconds=cfg.stall_seconds,
            action_floor_seconds=cfg.action_stall_seconds, acting=lambda: control.acting,
            in_action=lambda: control.executor.in_action)
        self._time_compute(model)
        if self._device.type == "cuda":
            self._report.device_name = torch.cuda.get_device_name(self._device)
        self._dtype_hook = self._see_compute_dtype(model)
        if cfg.record_memory_history:
            set_recording(True)
        if cfg.embedded_agent:
            ensure_agent(cfg.agent_url, identity.local_rank, cfg.embedded_agent_idle_seconds, cfg.token)
        publisher.start()

    def _see_compute_dtype(self, model: torch.nn.Module | None) -> Any:
        """A hook on the model's first forward, then removed: the dtype its matrix multiplies run in (autocast's,
        or the parameters'), for the device's peak FLOP/s."""
        first = next(iter(model.parameters()), None) if model is not None else None
        if first is None:
            return None
        report, device = self._report, self._device.type

        def seen(_module: torch.nn.Module, _args: Any) -> None:
            autocast = torch.is_autocast_enabled(device)
            report.compute_dtype = dtype_name(torch.get_autocast_dtype(device) if autocast else first.dtype)
            handle.remove()

        handle = model.register_forward_pre_hook(seen)  # type: ignore[union-attr]
        return handle

    def _time_compute(self, model: torch.nn.Module | None) -> None:
        """``trainpatrol_compute_seconds_total``: the rank's forward and backward, apart from its waits for peers."""
        if model is None or self._recorder.compute_clock is not None:
            return
        clock = ComputeClock(model, self._device)
        if clock.active:
            self._recorder.compute_clock = clock
            self._recorder.totals.compute = clock.seconds  # 0, pushed from the first snapshot with the step counter

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
            UpdateHooks(optimizer, skip=self.config.skip_nonfinite_updates, after_step=self._after_optimizer_step,
                        charge=self._recorder.charge)
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
        """Wrap the training batches: time each wait, act before each fetch, and keep the position for checkpoints.

        Args:
            loader: The batches, usually a ``DataLoader``. Its position and the RNG it draws from are saved, so
                ``restore`` continues mid-epoch with the same batches.

        Returns:
            The same batches (and ``len``). A ``pause`` waits before the next fetch until ``resume``.

        Raises:
            SystemExit: Code 86 (``trainpatrol.STOP_EXIT_CODE``) once a ``stop`` is agreed and checkpointed.
        """
        self._report.audit_loader(loader, self._device.type == "cuda")
        self._control.boundary_driven = True
        return TimedLoader(loader, self._control.boundary, self._recorder.fetched, self._loader_tracker)

    def step(self, loss: torch.Tensor, *, grad_norm: torch.Tensor | float | None = None,
             batch_size: int | None = None, tokens: int | None = None,
             learning_rates: list[float] | None = None) -> None:
        """Record one micro-batch; every ``grad_accum_steps``-th call closes an optimizer step.

        Call after ``backward()``, before ``optimizer.step()`` and ``zero_grad()``. Nothing is read on the host:
        on a GPU the loss and grad norm tensors are stacked and copied off the device with the next few steps
        (about ``readback_lag_seconds``), so leave them as they are until then. One changed in place, or a CUDA
        graph's output overwritten by its next replay, is logged, and Patrol then copies each step's values at once.

        Args:
            loss: The micro-batch's loss, unscaled: not divided for accumulation (Patrol averages).
            grad_norm: The pre-clip total that ``clip_grad_norm_`` returns, on the step's last micro-batch.
                Default: computed from the model's gradients when Patrol has a model, else none.
            batch_size: Samples, added to ``trainpatrol_samples_total``.
            tokens: Tokens, added to ``trainpatrol_tokens_total``.
            learning_rates: One per param group. Default: read from the optimizer.

        Raises:
            RuntimeError: On the CPU, when an action is waiting and the loop has no boundary where Patrol can
                act: no ``loader``, no ``optimizer``, no ``boundary()`` call.
        """
        start = time.perf_counter()  # Patrol's time from here on, for trainpatrol_probe_overhead_ratio
        recorder = self._recorder
        # only a CPU step checks: a CUDA step keeps its cost to what it must do (and the record counts the check)
        no_boundary = recorder.on_cpu and self._hooks is None and not self._control.boundary_driven
        if recorder.record(loss, grad_norm, batch_size, tokens, learning_rates, start) and no_boundary \
                and self._commands:
            self._control.cannot_act()

    def boundary(self) -> None:
        """Act here: exchange the control word with the other ranks when due and carry out agreed actions.

        For a loop without ``loader``; once called, Patrol no longer acts after ``optimizer.step()``. Call it
        between optimizer steps, at the same point on every rank. A ``pause`` waits here until ``resume``.

        Raises:
            SystemExit: Code 86 (``trainpatrol.STOP_EXIT_CODE``) once a ``stop`` is agreed and checkpointed.
        """
        self._control.boundary_driven = True
        self._control.boundary()

    def evaluate(self, val_loss: float | torch.Tensor) -> None:
        """Record a validation loss. A new best is checkpointed at the next boundary, and that checkpoint is
        never rotated away (``PatrolConfig.keep_best_checkpoint``).

        Args:
            val_loss: The loss; a tensor is read on the host here (evaluation is off the hot path).
        """
        self._recorder.fold_in()
        value = float(val_loss)
        self._latest.validation_loss = value
        self._validation_history.append({"step": self._totals.steps, "value": value, "time": time.time()})
        if self.config.keep_best_checkpoint and value < self._best_val:
            self._best_val = self._training.best_pending = value
            self.request("checkpoint", f"new best validation loss {value:.6g}", source="best_validation_loss")

    def restore(self, path: str | Path = "latest") -> Restored:
        """Load a checkpoint: model, optimizer, scheduler, scaler, RNG, the loader's position and extra state.

        Args:
            path: ``"latest"``: the newest complete checkpoint whose state is finite. Else a checkpoint directory.

        Returns:
            What was restored: ``step``, ``path``, ``epoch``, ``reason`` and the newer checkpoints ``skipped``
            with why. False when ``"latest"`` finds nothing to restore (a fresh run).

        Raises:
            FileNotFoundError: ``path`` is not a complete checkpoint (no ``meta.json``).

        Example::

            restored = patrol.restore("latest")
            for epoch in range(restored.epoch, epochs): ...
        """
        self._recorder.fold_in()
        restored = self._control.executor.restore(path)
        if restored:
            self._start_at(restored.step)
            best = self._control.executor.best_validation_loss()
            if best is not None:  # a later best must beat the restored run's
                self._best_val = min(self._best_val, best)
        return restored

    def request(self, action: str, reason: str = "", *, source: str = "local") -> int:
        """Ask for an action; every rank carries it out at the same, next agreed boundary.

        Args:
            action: ``checkpoint``, ``pause``, ``resume``, ``stop``, ``empty_cache`` or ``capture``.
            reason: Why, for the logs and the evidence bundle.
            source: Who asks, recorded with it.

        Returns:
            The command's id. An action already pending is not queued twice.

        Raises:
            ValueError: ``action`` is not one of these.

        Example::

            if patrol.step_count % 1000 == 0:
                patrol.request("checkpoint", "every 1000 steps")
        """
        if action not in ACTIONS:
            raise ValueError(f"`Patrol.request({action!r})`: not an action; expected one of {', '.join(ACTIONS)}.")
        return self._commands.request(action, reason, source)

    def close(self) -> None:
        """Read the last steps back, wait for the writes under way (the rank reads ``stopping`` meanwhile), push a
        final snapshot and unhook the optimizer (leaving ``with`` does it)."""
        if self.state == "closed":
            return
        if self.state == "running":  # training is over: waiting for the writes below is no stall
            self._record.state = "stopping"
        self._recorder.catch_up(wait=True)
        self._control.executor.close()  # a checkpoint being written is durable, a report written, first
        if self.state not in ("stopped",):
            self._record.state = "closed"
        self._publisher.stop(final_push=True)
        if self._hooks is not None:
            self._hooks.remove()
        if self._recorder.compute_clock is not None:
            self._recorder.compute_clock.remove()
        if self._dtype_hook is not None:
            self._dtype_hook.remove()

    def __enter__(self) -> Patrol:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """``close``; after a ``torch.OutOfMemoryError``, first an evidence bundle. The exception propagates."""
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
        bundle = self._report.oom_evidence(self._evidence, exc)
        self._publisher.push_now()
        log.error("trainpatrol: out of memory at step %d; evidence in %s", self._totals.steps, bundle)
        return bundle

    # --- framework hooks: only trainpatrol.integrations calls these ---------------------------
    def _attach(self, step: int, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                scheduler: Any, *, flops_per_token: float = 0.0, flops_per_step: float = 0.0) -> bool:
        """A framework callback takes over at its global ``step``: it fills in what this Patrol was built
        without (the model's FLOPs per token as the framework counts them, where the config gives none), calls
        ``boundary()`` itself after each optimizer step, and each update is judged from the gradients before it.
        Returns whether the ranks agree through ``torch.distributed``."""
        if self._dtype_hook is None and model is not None:
            self._dtype_hook = self._see_compute_dtype(model)
        self._time_compute(model)
        report = self._report
        if not (report.flops_per_token or report.flops_per_step):
            report.flops_per_token, report.flops_per_step = flops_per_token, flops_per_step
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
