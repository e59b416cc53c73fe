"""The rank's book of requested actions: pending until agreed, then done (so a repeat is ignored)."""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any


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
