"""``POST /v1/push/stream``: a rank's pushes as one long-lived request, one JSON snapshot per line.

A request per push cost the agent about 0.4 ms of HTTP handling (parsing, a task, two socket
writes), more than the push itself; at 64 ranks that alone broke the 2 % CPU budget
(bench/scrape.py). On a stream a push is one more chunk of a body that is already open, and the
agent writes only when it has something to say. The answer is NDJSON, streamed:

- ``{"run", "rank", "seq", "commands": [...]}`` after a snapshot whose run has commands for it;
- ``{"line", "status", "detail"[, "errors"]}`` for a refused line (422 invalid, 413 too long);
  the stream goes on with the next line;
- ``{"accepted", "refused"}`` once the request body ends; then the answer ends.

A line with ``changed`` instead of ``samples`` carries only the sample values that moved since the
same rank's last line on the stream (protocol.SnapshotDelta); a Patrol sends a whole snapshot first
and after any refusal. A plain POST with a Content-Length body of several lines is a finite stream and gets the same
answer. A body that stops without a final newline still counts its last line. Lines are counted in
``trainpatrol_pushes_total{outcome}`` as single pushes are.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from starlette.types import Receive, Send

from ..collectors.agent_self import AgentStats
from ..protocol import Command, RankSnapshot, SnapshotDelta
from .problems import validation_problem

NDJSON = b"application/x-ndjson"
MAX_RANKS_PER_STREAM = 1024
"""Ranks whose last snapshot a stream keeps as the base of their deltas (a Patrol sends one)."""


class PushStream:
    """Reads one stream's lines as they arrive and answers each rank's commands at once."""

    def __init__(self, *, accept: Callable[[RankSnapshot], list[Command]], stats: AgentStats, max_line: int,
                 idle_seconds: float) -> None:
        self.accept, self.stats = accept, stats
        self.max_line, self.idle_seconds = max_line, idle_seconds

    async def serve(self, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", NDJSON), (b"cache-control", b"no-store")]})
        counts = {"accepted": 0, "refused": 0}
        bases: dict[tuple[str, int], RankSnapshot] = {}  # each rank's last snapshot on this stream
        pending, number, skipping, more = b"", 0, False, True
        idle = _IdleWatch(self.idle_seconds)
        try:
            while more:
                try:
                    message = await receive()
                except asyncio.CancelledError:
                    if not idle.expired:
                        raise
                    break  # a peer silent this long is gone without a FIN: end the answer, free the task
                idle.touch()
                if message["type"] == "http.disconnect":
                    return  # nobody left to answer; a partial last line is dropped, the next push restores it
                more = message.get("more_body", False)
                *lines, rest = (pending + message.get("body", b"")).split(b"\n")
                for line in lines:
                    number += 1
                    if skipping:  # the tail of a line already refused as too long
                        skipping = False
                        continue
                    await self._line(line, number, counts, bases, send)
                pending = rest
                if len(pending) > self.max_line:
                    number += 1
                    skipping, pending = True, b""
                    await self._too_long(number, counts, send)
        finally:
            idle.close()
        if pending.strip() and not skipping:
            await self._line(pending, number + 1, counts, bases, send)
        await send({"type": "http.response.body", "body": _json_line(counts), "more_body": False})

    async def _line(self, line: bytes, number: int, counts: dict[str, int],
                    bases: dict[tuple[str, int], RankSnapshot], send: Send) -> None:
        if not line.strip():
            return
        if len(line) > self.max_line:
            await self._too_long(number, counts, send)
            return
        try:
            delta = SnapshotDelta.model_validate_json(line)
            key = (delta.run, delta.rank)
            snapshot = delta.whole(bases.get(key))
        except (ValidationError, ValueError) as exc:
            self.stats.count("pushes", "invalid")
            counts["refused"] += 1
            problem = validation_problem(exc) if isinstance(exc, ValidationError) else {"detail": str(exc)}
            bases.clear()  # deltas after a refused line would build on the wrong base: whole lines first
            await _reply(send, {"line": number, "status": 422, **problem})
            return
        if key not in bases and len(bases) >= MAX_RANKS_PER_STREAM:
            bases.pop(next(iter(bases)))
        bases[key] = snapshot
        counts["accepted"] += 1
        commands = self.accept(snapshot)
        if commands:
            await _reply(send, {"run": snapshot.run, "rank": snapshot.rank, "seq": snapshot.seq,
                                "commands": [c.model_dump(mode="json") for c in commands]})

    async def _too_long(self, number: int, counts: dict[str, int], send: Send) -> None:
        self.stats.count("pushes", "too_large")
        counts["refused"] += 1
        await _reply(send, {"line": number, "status": 413,
                            "detail": f"Line {number} is longer than the limit of {self.max_line} bytes; "
                                      "skipped to the next newline."})


class _IdleWatch:
    """Cancels the stream's task once no message came for ``seconds``, with one timer per stream
    rather than a timeout around every read (which cost more than a small push)."""

    def __init__(self, seconds: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._seconds, self._last = seconds, self._loop.time()
        self.expired = False
        self._timer = self._loop.call_later(seconds, self._check)

    def touch(self) -> None:
        self._last = self._loop.time()

    def close(self) -> None:
        self._timer.cancel()
        if self.expired and self._task is not None:
            self._task.uncancel()

    def _check(self) -> None:
        left = self._last + self._seconds - self._loop.time()
        if left > 0:
            self._timer = self._loop.call_later(left, self._check)
        elif self._task is not None:
            self.expired = True
            self._task.cancel()


def _json_line(value: dict[str, Any]) -> bytes:
    return json.dumps(value).encode() + b"\n"


async def _reply(send: Send, value: dict[str, Any]) -> None:
    await send({"type": "http.response.body", "body": _json_line(value), "more_body": True})
