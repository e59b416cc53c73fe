"""Pushes the rank's snapshot to its agent about once a second, from a background thread.

The periodic pushes travel on one kept-open stream (probe.push_stream), so each costs the agent one
chunk rather than one HTTP request. ``push_now`` (a state change, the final snapshot) is one
``POST /v1/push``, confirmed when it returns;
its kept-alive connection idles between state changes, so on a connection error (the agent closed
it, or restarted) the request is sent once more on a new connection, within ``timeout``, and the
final "closed" push still arrives. Pushes are bounded in time, retried with backoff, and a dropped
push is counted; the training loop never waits for the agent. Commands in the agent's replies are
handed to ``on_commands`` as they arrive.

Periodic pushes fall on whole multiples of the interval on the wall clock (``next_push_delay``), so
the ranks of a node push in the same instant and their agent wakes once for all of them rather than
once per rank: on an idle core a wake-up costs the agent more than a small push (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import select
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from ..agent.config import DEFAULT_PORT
from .push_stream import RUN_KEY_HEADER, PushStream
from .snapshot_delta import DeltaEncoder

log = logging.getLogger("trainpatrol")


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
        self._run_key = run_key
        self.interval = interval
        self._timeout = timeout
        self._max_backoff = max_backoff
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._thread: threading.Thread | None = None
        self.dropped = 0
        self.delivered = 0
        self._conn: http.client.HTTPConnection | None = None
        self._stream = PushStream(self._host, self._port, token, timeout, run_key=run_key)
        self._delta = DeltaEncoder()
        self._conn_lock = threading.RLock()
        self._failing = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="trainpatrol-publisher", daemon=True)
        self._thread.start()

    def push_now(self) -> bool:
        """One push from the calling thread (a state change, a final snapshot), by its own request:
        when it returns True the agent has taken it in, where the stream hands it over in batches."""
        try:
            self._post(json.dumps(self._snapshot()).encode())
            return True
        except Exception as exc:
            self._failed(exc)
            return False

    def _push_periodic(self) -> bool:
        try:
            self._push_on_stream(self._snapshot())
            return True
        except Exception as exc:
            self._failed(exc)
            return False

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # BlockingIOError: already awake; OSError: stopped
            self._wake_w.send(b"!")

    def stop(self, final_push: bool = True) -> None:
        self._stop.set()
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout=self._timeout * 2 + 1)
        if final_push:
            self.push_now()
        with self._conn_lock:
            self._stream.close()  # the agent still handles the lines it has; the final push came after them
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        self._wake_r.close()
        self._wake_w.close()

    def _loop(self) -> None:
        backoff = self.interval
        while not self._stop.is_set():
            if self._push_periodic():
                backoff = self.interval
                self._wait(next_push_delay(self.interval, time.time()))
            else:
                backoff = min(backoff * 2, self._max_backoff)
                self._wait(backoff)

    def _wait(self, seconds: float) -> None:
        """Until ``seconds`` pass or ``wake``; meanwhile hands on commands the agent streams back."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
            watched: list[socket.socket | PushStream] = [self._wake_r]
            if self._stream.is_open:
                watched.append(self._stream)
            try:
                ready = select.select(watched, [], [], left)[0]
            except (ValueError, OSError):
                continue  # the training thread closed the stream meanwhile; watch the wake-up alone
            if self._wake_r in ready:
                self._wake_r.recv(4096)
                return
            if ready:
                try:
                    self._take_replies()
                except Exception as exc:
                    self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        self.dropped += 1
        if not self._failing:
            log.warning("trainpatrol: push to agent %s:%d failed (%s); retrying with backoff",
                        self._host, self._port, exc)
        self._failing = True

    def _push_on_stream(self, snapshot: dict[str, Any]) -> None:
        with self._conn_lock:
            try:
                if not self._stream.is_open:
                    self._stream.open()
                    self._delta.reset()
                self._stream.send(self._delta.encode(snapshot))
            except OSError:
                self._stream.close()
                raise
        self._delivered()  # its answer, if any, comes with a later batch: _wait hands it on

    def _take_replies(self) -> None:
        """Commands and refusals the agent has streamed back so far; a stream it ended is closed."""
        with self._conn_lock:
            if not self._stream.is_open:
                return
            try:
                replies = self._stream.replies()
            finally:
                if self._stream.ended:
                    self._stream.close()
        self._handle(replies)

    def _handle(self, replies: list[dict[str, Any]]) -> None:
        for reply in replies:
            if reply.get("commands"):
                self._on_commands(reply["commands"])
            elif "status" in reply:
                with self._conn_lock:
                    self._delta.reset()  # the agent dropped its base of our deltas
                self._failed(RuntimeError(f"agent refused a push ({reply['status']}): {reply.get('detail')}"))

    def _delivered(self) -> None:
        if self._failing:
            log.warning("trainpatrol: pushes to agent %s:%d work again", self._host, self._port)
        self._failing = False
        self.delivered += 1

    def _post(self, body: bytes) -> None:
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        if self._run_key:
            headers[RUN_KEY_HEADER] = self._run_key
        with self._conn_lock:
            started = time.monotonic()
            try:
                status, data = self._request(body, headers)
            except (ConnectionError, http.client.HTTPException) as exc:
                # The kept-alive connection went stale: the agent closed it while idle (uvicorn after
                # 5 s; state-change pushes come minutes apart) or restarted. A push is a whole
                # snapshot, so sending it again is harmless: once, on a new connection, while the
                # first try has left time within ``timeout``. A timeout is not retried.
                if time.monotonic() - started >= self._timeout:
                    raise
                log.debug("trainpatrol: push to agent %s:%d failed (%r); once more on a new connection",
                          self._host, self._port, exc)
                status, data = self._request(body, headers)
        if status != 200:
            raise RuntimeError(f"agent answered {status}: {data[:300]!r}")
        self._delivered()
        commands = json.loads(data).get("commands", [])
        if commands:
            self._on_commands(commands)

    def _request(self, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """One ``POST /v1/push`` on the kept-alive connection (a new TCP connection per push costs the
        agent more than the push), opened if there is none; a connection that failed is dropped."""
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        try:
            self._conn.request("POST", "/v1/push", body=body, headers=headers)
            resp = self._conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException):
            self._conn.close()
            self._conn = None
            raise
