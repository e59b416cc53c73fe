"""The rank's control loop: requested actions, the lagged control word exchanged at step boundaries,
and the executor that carries out what the ranks agreed."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..control.checkpoint import Checkpointer, TrainingState
from ..control.commands import CommandBook, RunRecord
from ..control.coordinator import Agreement, Coordinator, encode
from ..control.evidence import EvidenceWriter
from ..control.executor import Executor, RankFacts
from .config import PatrolConfig
from .identity import Identity
from .step_recorder import StepRecorder


def guard_trips(commands: CommandBook, guard_actions: dict[str, str]) -> Callable[[list[tuple[str, str]]], None]:
    """What the step recorder calls with the guards that tripped: request the actions configured for them."""
    def trip(tripped: list[tuple[str, str]]) -> None:
        for guard, detail in tripped:
            action = guard_actions.get(guard)
            if action:
                commands.request(action, f"local guard {guard}: {detail}", source=f"guard:{guard}")
    return trip


class PeriodicCheckpoints:
    """When rank 0 asks for the next periodic checkpoint: every ``steps`` optimizer steps, or once ``seconds``
    have passed since the last one."""

    def __init__(self, steps: int, seconds: float) -> None:
        self._steps, self._seconds = steps, seconds
        self._last_step, self._last_time = 0, time.perf_counter()

    def due(self, step: int, now: float) -> str:
        """Why a checkpoint is due at ``step`` ("" when none is)."""
        if self._steps and step - self._last_step >= self._steps:
            why = f"periodic checkpoint every {self._steps} steps"
        elif self._seconds and now - self._last_time >= self._seconds:
            why = f"periodic checkpoint every {self._seconds:g} s"
        else:
            return ""
        self._last_step, self._last_time = step, now
        return why


class ControlLoop:
    def __init__(self, cfg: PatrolConfig, identity: Identity, recorder: StepRecorder, *, commands: CommandBook,
                 coordinator: Coordinator, record: RunRecord, checkpointer: Checkpointer, evidence: EvidenceWriter,
                 training: TrainingState, announce: Callable[[], object], context: Callable[[], dict[str, Any]],
                 rearm_guards: Callable[[], None]) -> None:
        """``announce``: push the state now; ``context``: what an evidence bundle says of the rank."""
        self._recorder, self._accum = recorder, cfg.grad_accum_steps
        self.commands, self.coordinator = commands, coordinator
        self.executor = Executor(
            RankFacts(cfg.run, identity.rank, identity.world_size, identity.device, cfg.guard_actions,
                      cfg.pause_timeout_seconds, cfg.pause_poll_seconds, cfg.background_checkpoints),
            checkpointer=checkpointer, coordinator=coordinator, commands=commands, record=record,
            evidence=evidence, training=training, control_word=self.control_word, announce=announce,
            context=context, rearm_guards=rearm_guards)
        self._periodic = PeriodicCheckpoints(cfg.checkpoint_every_steps, cfg.checkpoint_every_seconds) \
            if identity.rank == 0 and (cfg.checkpoint_every_steps or cfg.checkpoint_every_seconds) else None
        self.acting = False
        """True while the training thread carries out agreed actions (the stall watch looks away)."""
        self.boundary_driven = False
        """Whether the caller runs ``boundary()`` (the loader wrapper, a framework callback, a loop of its own);
        until then Patrol acts from its hook after ``optimizer.step()``."""

    def _exchange(self) -> Agreement | None:
        """The control word exchanged, when one is due."""
        if not self.commands and not self.coordinator.distributed:
            return None
        recorder = self._recorder
        step = recorder.totals.steps
        if recorder.totals.micro_steps % self._accum or not self.coordinator.due(step):
            return None
        recorder.fold_in()  # the control word carries the recent step time
        agreed = self.coordinator.exchange(step, self.control_word())
        recorder.latest.interval_steps = self.coordinator.interval
        return agreed

    def control_word(self) -> list[int]:
        pending = {a: c["id"] for a, c in self.commands.pending().items()}
        history = self._recorder.history
        return encode(pending, history.median("step_seconds", 20) if history.records else 0.0, time.time())

    def cannot_act(self) -> None:
        action = next(iter(self.commands.pending().values()))
        raise RuntimeError(f"trainpatrol: `{action['action']}` was requested ({action['reason']}), but this loop has "
                           "no step boundary where Patrol can act: iterate batches through `patrol.loader(...)`, "
                           "pass `optimizer=` to Patrol, or call `patrol.boundary()` between steps.")

    def boundary(self) -> None:
        """Exchange the control word when due and carry out agreed actions. Its own time is Patrol's overhead;
        the actions' is not."""
        start = time.perf_counter()
        recorder = self._recorder
        if self._periodic is not None:
            reason = self._periodic.due(recorder.totals.steps, start)
            if reason:
                self.commands.request("checkpoint", reason, source="periodic")
        agreed = self._exchange()
        if recorder.totals.steps:
            self.executor.reserve_staging()
        recorder.probe_since_step += time.perf_counter() - start
        if agreed is not None and agreed.commands:
            recorder.catch_up(wait=True)
            self.acting = True
            try:
                self.executor.execute(agreed)
            finally:
                self.acting = False
            recorder.last_step_end = time.perf_counter()
