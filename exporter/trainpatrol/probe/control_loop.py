"""The rank's control loop: requested actions, the lagged control word exchanged at step boundaries,
and the executor that carries out what the ranks agreed."""

from __future__ import annotations

import time

from ..control.commands import CommandBook
from ..control.coordinator import Coordinator, encode
from ..control.executor import Executor
from .step_recorder import StepRecorder


class ControlLoop:
    def __init__(self, commands: CommandBook, coordinator: Coordinator, executor: Executor, recorder: StepRecorder,
                 grad_accum_steps: int) -> None:
        self.commands, self.coordinator, self.executor = commands, coordinator, executor
        self._recorder, self._accum = recorder, grad_accum_steps
        self.boundary_driven = False
        """Whether the caller runs ``boundary()`` (the loader wrapper, a framework callback, a loop of its own);
        until then Patrol acts from its hook after ``optimizer.step()``."""

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
        """Exchange the control word when due and carry out agreed actions."""
        if not self.commands and not self.coordinator.distributed:
            return
        recorder = self._recorder
        if recorder.totals.micro_steps % self._accum:
            return
        start = time.perf_counter()
        step = recorder.totals.steps
        if not self.coordinator.due(step):
            return
        recorder.absorb_host()  # the control word carries the recent step time
        agreed = self.coordinator.exchange(step, self.control_word())
        recorder.latest.interval_steps = self.coordinator.interval
        recorder.probe_since_step += time.perf_counter() - start
        if agreed is not None and agreed.commands:
            recorder.catch_up(wait=True)
            self.executor.execute(agreed)
            recorder.last_step_end = time.perf_counter()
