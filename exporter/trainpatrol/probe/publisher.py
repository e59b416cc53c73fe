"""Pushes the rank's whole snapshot to its agent about once a second, from a background thread.

Each push is one ``POST /v1/push`` on a kept-alive connection, and the reply carries the commands
waiting for the rank, handed to ``on_commands``. ``push_now`` (a state change, the final snapshot)
is the same request from the calling thread, confirmed when it returns. A push is a whole
snapshot, so a connection the agent closed while idle (or a restarted agent) costs one more try on
a new connection, within ``timeout``. Pushes are bounded in time, retried with backoff, and a
dropped push is counted; the training loop never waits for the agent.

Every connection begins with the agent proving it knows the token or its user's agent key
(trainpatrol.handshake), before the token or the run key is sent on it.

Periodic pushes fall on whole multiples of the interval on the wall clock (``next_push_delay``), so
the ranks of a node push in the same instant and their agent wakes once for all of them.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from .. import handshake
from ..agent.config import DEFAULT_PORT

log = logging.getLogger("trainpatrol")
PATH = "/v1/push"
RUN_KEY_HEADER = "X-Trainpatrol-Run-Key"
"""Proves the run's key (probe.run_key) with every push."""


FINAL_PUSH_TRIES = 3
"""How often ``stop`` tries its final push: a busy agent can miss one push's timeout."""


def next_push_delay(interval: float, now: float) -> float:
    """Seconds from ``now`` (wall clock) to the next whole multiple of ``interval``, skipping one
    that is less than a tenth of an interval away (a push that ran late must not be followed at once)."""
    delay = interval - now % interval
    return delay + interval if delay < interval / 10 else delay


class Publisher:
    def __init__(self, agent_url: str, snapshot: Callable[[], dict[str, Any]],
                 on_commands: Callable[[list[dict[str, Any]]], None], *, token: str = "", run_key: str = "",
                 interval: float = 1.0, timeout: float = 1.0, max_backoff: float = 5.0) -> None:
        parsed = urllib.parse.urlparse(agent_url)
        self._host = parsed.hostname or "127.0.0.1"
        self._port = parsed.port or DEFAULT_PORT
        self._snapshot = snapshot
        self._on_commands = on_commands
        self._token = token
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        if run_key:
            self._headers[RUN_KEY_HEADER] = run_key
        self.interval = interval
        self._timeout = timeout
        self._max_backoff = max_backoff
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: http.client.HTTPConnection | None = None
        self._conn_lock = threading.Lock()
        self._failing = False
        self.dropped = 0
        self.delivered = 0
        self.cpu_seconds = 0.0
        """The background thread's CPU time so far, for ``trainpatrol_probe_overhead_ratio``."""

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="trainpatrol-publisher", daemon=True)
        self._thread.start()

    def push_now(self) -> bool:
        """One push from the calling thread; True once the agent has taken it in."""
        try:
            self._post(json.dumps(self._snapshot()).encode())
            return True
        except Exception as exc:
            self._failed(exc)
            return False

    def wake(self) -> None:
        """Push at once rather than at the next whole interval."""
        self._wake.set()

    def stop(self, final_push: bool = True) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self._timeout * 2 + 1)
        if final_push:  # the rank's last state (closed, stopped): an agent without it would count the rank down
            any(self.push_now() for _ in range(FINAL_PUSH_TRIES))
        with self._conn_lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _loop(self) -> None:
        backoff = self.interval
        while not self._stop.is_set():
            pushed = self.push_now()
            self.cpu_seconds = time.thread_time()
            if pushed:
                backoff = self.interval
                delay = next_push_delay(self.interval, time.time())
            else:
                backoff = delay = min(backoff * 2, self._max_backoff)
            self._wake.wait(delay)
            self._wake.clear()

    def _failed(self, exc: Exception) -> None:
        self.dropped += 1
        if not self._failing:
            log.warning("trainpatrol: push to agent %s:%d failed (%s); retrying with backoff",
                        self._host, self._port, exc)
        self._failing = True

    def _post(self, body: bytes) -> None:
        with self._conn_lock:
            started = time.monotonic()
            try:
                status, data = self._request(body)
            except (ConnectionError, http.client.HTTPException) as exc:
                # The kept-alive connection went stale (the agent closed it while idle, or restarted):
                # once more on a new connection, while the first try left time within ``timeout``.
                # A timeout is not retried.
                if time.monotonic() - started >= self._timeout:
                    raise
                log.debug("trainpatrol: push to agent %s:%d failed (%r); once more on a new connection",
                          self._host, self._port, exc)
                status, data = self._request(body)
        if status != 200:
            raise RuntimeError(f"agent answered {status}: {data[:300]!r}")
        if self._failing:
            log.warning("trainpatrol: pushes to agent %s:%d work again", self._host, self._port)
        self._failing = False
        self.delivered += 1
        commands = json.loads(data).get("commands", [])
        if commands:
            self._on_commands(commands)

    def _request(self, body: bytes) -> tuple[int, bytes]:
        """One push on the kept-alive connection, opened if there is none, and only once the agent proved
        itself on it (trainpatrol.handshake): the token and run key go to the agent alone, and commands
        come from it alone. A connection that failed is dropped."""
        if self._conn is None:
            self._conn = handshake.connect(self._host, self._port, self._token, self._timeout)
        try:
            self._conn.request("POST", PATH, body=body, headers=self._headers)
            resp = self._conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException):
            self._conn.close()
            self._conn = None
            raise
