"""The rank's books: the actions requested (pending until agreed, then done, so a repeat is ignored), and what
the executor recorded (the run's state, its recent actions and their counts, the last checkpoint and evidence),
which the rank's pushes read."""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from ..protocol import ActionRecord

log = logging.getLogger("trainpatrol")


class CommandBook:
    """Thread-safe: guards and the training thread request, the publisher thread hands on the agent's."""

    def __init__(self, run: str, started: float, on_request: Callable[[], None]) -> None:
        self._run, self._started, self._on_request = run, started, on_request
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, Any]] = {}
        self.done: deque[int] = deque(maxlen=512)

    def __bool__(self) -> bool:
        return bool(self._pending)

    def request(self, action: str, reason: str = "", source: str = "local", command_id: int | None = None,
                alert: dict[str, Any] | None = None) -> int:
        cid = command_id or secrets.randbelow(2**31 - 2) + 1
        with self._lock:
            if cid in self.done or action in self._pending:
                return cid
            self._pending[action] = {"id": cid, "action": action, "reason": reason, "source": source,
                                     "alert": alert}
        self._on_request()
        return cid

    def from_agent(self, commands: list[dict[str, Any]]) -> None:
        for c in commands:
            # a command queued before this process started was meant for an earlier incarnation
            # of the run (e.g. the stop that ended the job this one restores from)
            if c.get("run") == self._run and float(c.get("created", 0)) >= self._started:
                self.request(c["action"], c.get("reason", ""), c.get("source", "agent"), int(c["id"]),
                             c.get("alert"))

    def pending(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return dict(self._pending)

    def mark_done(self, ids: Iterable[int]) -> None:
        with self._lock:
            for cid in ids:
                self.done.append(cid)
                for action, c in list(self._pending.items()):
                    if c["id"] == cid:
                        del self._pending[action]


class RunRecord:
    def __init__(self) -> None:
        self.state = "running"
        self.actions: deque[ActionRecord] = deque(maxlen=32)
        self.action_counts: dict[tuple[str, str], float] = {}
        self.checkpoint_failures = 0.0
        self.last_checkpoint = ""
        self.last_checkpoint_time = math.nan
        self.last_checkpoint_step = math.nan
        self.checkpoint_blocked_seconds = 0.0
        """Training time spent waiting for checkpoints (a background write's staging, a pause's or stop's whole
        write)."""
        self.last_checkpoint_write_seconds = math.nan
        """From the start of the last successful checkpoint until it was durable."""
        self.last_evidence = ""

    def action(self, cid: int, action: str, outcome: str, step: int, detail: str = "", path: str = "",
               evidence: str = "") -> None:
        self.actions.append(ActionRecord(id=cid, action=action, outcome=outcome, step=step,  # type: ignore[arg-type]
                                         time=time.time(), detail=detail, checkpoint=path, evidence=evidence))
        key = (action, outcome)
        self.action_counts[key] = self.action_counts.get(key, 0) + 1
        log.warning("trainpatrol: %s at step %d: %s %s", action, step, outcome, detail)

    def checkpointed(self, path: str, step: int) -> None:
        self.last_checkpoint = path
        self.last_checkpoint_time, self.last_checkpoint_step = time.time(), float(step)
