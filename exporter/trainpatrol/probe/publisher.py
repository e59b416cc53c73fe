"""Pushes the rank's snapshot to its agent about once a second, from a background thread.

Pushes are bounded in time, retried with backoff, and a dropped push is counted; the training loop
never waits for the agent. Commands in the agent's replies are handed to ``on_commands``.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

log = logging.getLogger("trainpatrol")


class Publisher:
    def __init__(self, agent_url: str, snapshot: Callable[[], dict[str, Any]],
                 on_commands: Callable[[list[dict[str, Any]]], None], *, token: str = "",
                 interval: float = 1.0, timeout: float = 1.0, max_backoff: float = 5.0) -> None:
        parsed = urllib.parse.urlparse(agent_url)
        self._host = parsed.hostname or "127.0.0.1"
        self._port = parsed.port or 9400
        self._snapshot = snapshot
        self._on_commands = on_commands
        self._token = token
        self.interval = interval
        self._timeout = timeout
        self._max_backoff = max_backoff
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.dropped = 0
        self.delivered = 0
        self._conn: http.client.HTTPConnection | None = None
        self._conn_lock = threading.Lock()
        self._failing = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="trainpatrol-publisher", daemon=True)
        self._thread.start()

    def push_now(self) -> bool:
        """One push from the calling thread (final snapshots, paused loops). True on success."""
        try:
            self._push_once()
            return True
        except Exception as exc:
            self._failed(exc)
            return False

    def wake(self) -> None:
        self._wake.set()

    def stop(self, final_push: bool = True) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self._timeout * 2 + 1)
        if final_push:
            self.push_now()
        with self._conn_lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _loop(self) -> None:
        backoff = self.interval
        while not self._stop.is_set():
            backoff = self.interval if self.push_now() else min(backoff * 2, self._max_backoff)
            self._wake.wait(backoff)
            self._wake.clear()

    def _failed(self, exc: Exception) -> None:
        self.dropped += 1
        if not self._failing:
            log.warning("trainpatrol: push to agent %s:%d failed (%s); retrying with backoff",
                        self._host, self._port, exc)
        self._failing = True

    def _push_once(self) -> None:
        body = json.dumps(self._snapshot()).encode()
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        with self._conn_lock:
            # one kept-alive connection: a new TCP connection per push costs the agent more than the push
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
            try:
                self._conn.request("POST", "/v1/push", body=body, headers=headers)
                resp = self._conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException):
                self._conn.close()
                self._conn = None
                raise
        if resp.status != 200:
            raise RuntimeError(f"agent answered {resp.status}: {data[:300]!r}")
        if self._failing:
            log.warning("trainpatrol: pushes to agent %s:%d work again", self._host, self._port)
        self._failing = False
        self.delivered += 1
        commands = json.loads(data).get("commands", [])
        if commands:
            self._on_commands(commands)
