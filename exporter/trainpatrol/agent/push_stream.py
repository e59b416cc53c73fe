"""``POST /v1/push/stream``: a rank's pushes as one long-lived request, one JSON snapshot per line.

A request per push costs the agent more HTTP handling (parsing, a task, two socket writes) than the
push itself (docs/benchmarks.md). On a stream a push is one more chunk of a body that is already
open, and the agent writes only when it has something to say. The answer is NDJSON, streamed:

- ``{"run", "rank", "seq", "commands": [...]}`` after a snapshot whose run has commands for it;
- ``{"line", "status", "detail"[, "errors"]}`` for a refused line (422 invalid, 413 too long, 403 a
  run bound to another key or a namespace the token does not reach); the stream goes on with the next line;
- ``{"accepted", "refused"}`` once the request body ends; then the answer ends.

A line with ``changed`` instead of ``samples`` carries only the sample values that moved since the
same rank's last line on the stream (protocol.SnapshotDelta); a Patrol sends a whole snapshot first
and after any refusal. A plain POST with a Content-Length body of several lines is a finite stream
and gets the same answer. A body that stops without a final newline still counts its last line.
Lines are counted in ``trainpatrol_pushes_total{outcome}`` as single pushes are. The request's
headers prove the token and run key (agent.run_keys) for all of its lines.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from starlette.types import Receive, Send

from ..protocol import Command, RankSnapshot, SnapshotDelta
from .auth import PushProof
from .bounds import Refused
from .problems import invalid
from .stats import AgentStats
from .store import NeedsWholeSnapshot, StreamBase, StreamWrite

log = logging.getLogger(__name__)
NDJSON = b"application/x-ndjson"
Accept = Callable[[RankSnapshot, StreamWrite | None, PushProof], list[Command]]
"""Takes a valid snapshot in, with what a stream knows of it (agent.store.StreamWrite; None off a
stream), and what its request proved; returns the commands for the rank, or raises ``PushRefused``."""


class PushRefused(Refused):
    """A valid push that its proof does not allow (403)."""

    def __init__(self, detail: str) -> None:
        super().__init__(403, "run_key", detail)


MAX_RANKS_PER_STREAM = 1024
"""Ranks whose last write a stream remembers as the base of their deltas (a Patrol sends one)."""


@dataclass(eq=False)
class _Stream:
    """One open stream: where its answers go, its counts, and its ranks' delta bases."""

    send: Send
    proof: PushProof
    counts: dict[str, int] = field(default_factory=lambda: {"accepted": 0, "refused": 0})
    bases: dict[tuple[str, str, int], StreamBase] = field(default_factory=dict)
    """Per (namespace, run, rank), what this stream last wrote: its next delta's base (agent.store)."""
    open: bool = True
    queued: int = 0
    drained: asyncio.Event = field(default_factory=asyncio.Event)


class PushStream:
    """Reads every stream's lines as they arrive and handles them in batches across all streams:
    one push at a time runs slower than the same code warm (caches gone cold between pushes), and a
    scrape between two batches serves the body of the last one as it is. A batch starts
    ``batch_seconds`` after its first line, or at once when there are as many lines waiting as open
    streams: Patrol's ranks push on whole seconds, so the burst of a node is in, and waiting for the
    timer would only wake the agent once more. A push shows on /metrics, and a rank's commands are
    answered, within ``batch_seconds`` of its line; lines of one stream keep their order."""

    def __init__(self, *, accept: Accept, stats: AgentStats, max_line: int, idle_seconds: float,
                 batch_seconds: float = 0.25, after_batch: Callable[[], None] = lambda: None,
                 check_line: Callable[[bytes], None] = lambda line: None) -> None:
        self.accept, self.stats, self.after_batch, self.check_line = accept, stats, after_batch, check_line
        self.max_line, self.idle_seconds, self.batch_seconds = max_line, idle_seconds, batch_seconds
        self.lines_per_turn = 8
        """Lines handled before a scrape waiting meanwhile gets its turn: the ranks of a node push in
        the same instant, and 64 lines at once held the event loop for several milliseconds."""
        self._queue: list[tuple[_Stream, bytes, int]] = []
        self._flush: asyncio.TimerHandle | None = None
        self._handling = False
        self.open_streams = 0

    async def serve(self, receive: Receive, send: Send, proof: PushProof) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", NDJSON), (b"cache-control", b"no-store")]})
        stream = _Stream(send, proof)
        pending, number, skipping, more = b"", 0, False, True
        idle = _IdleWatch(self.idle_seconds)
        self.open_streams += 1
        try:
            while more:
                try:
                    message = await receive()
                except asyncio.CancelledError:
                    if not idle.expired:
                        raise
                    self.stats.count("refusals", "stream_idle")
                    break  # a peer silent this long is gone without a FIN: end the answer, free the task
                idle.touch()
                if message["type"] == "http.disconnect":
                    stream.open = False  # lines already whole are still handled; a partial one is dropped
                    return
                more = message.get("more_body", False)
                *lines, rest = (pending + message.get("body", b"")).split(b"\n")
                for line in lines:
                    number += 1
                    if skipping:  # the tail of a line already refused as too long
                        skipping = False
                    elif line.strip():
                        self._enqueue(stream, line, number)
                pending = rest
                if len(pending) > self.max_line:
                    number += 1
                    skipping, pending = True, b""
                    self._enqueue(stream, b"", number)  # refused as too long when its batch comes
        finally:
            idle.close()
            self.open_streams -= 1
        if pending.strip() and not skipping:
            self._enqueue(stream, pending, number + 1)
        if stream.queued:
            await stream.drained.wait()
        await send({"type": "http.response.body", "body": _json_line(stream.counts), "more_body": False})

    def _enqueue(self, stream: _Stream, line: bytes, number: int) -> None:
        self._queue.append((stream, line, number))
        stream.queued += 1
        stream.drained.clear()
        if self._handling:
            return  # the batch running takes this line too
        if len(self._queue) >= self.open_streams:
            if self._flush is not None:
                self._flush.cancel()
            self._start()
        elif self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(self.batch_seconds, self._start)

    def _start(self) -> None:
        self._flush, self._handling = None, True
        asyncio.get_running_loop().create_task(self._handle_queue())

    async def _handle_queue(self) -> None:
        """Every queued line, oldest first, including lines that arrive meanwhile."""
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                for i, (stream, line, number) in enumerate(batch):
                    if i and not i % self.lines_per_turn:
                        await asyncio.sleep(0)  # a scrape waiting meanwhile is answered between lines
                    try:
                        await self._line(stream, line, number)
                    except Exception:  # one line's failure, or a send to a peer that left, costs no other line
                        log.exception("push stream: line %d not handled", number)
                        stream.open = False
                    stream.queued -= 1
                    if not stream.queued:
                        stream.drained.set()
            try:
                self.after_batch()
            except Exception:  # the next scrape does the same work, and reports what fails
                log.exception("push stream: work after a batch failed")
        finally:
            self._handling = False

    async def _line(self, stream: _Stream, line: bytes, number: int) -> None:
        if not line or len(line) > self.max_line:
            self.stats.count("pushes", "too_large")
            stream.counts["refused"] += 1
            await self._reply(stream, {"line": number, "status": 413,
                                       "detail": f"Line {number} is longer than the limit of {self.max_line} "
                                                 "bytes; skipped to the next newline."})
            return
        try:
            self.check_line(line)
        except Refused as exc:  # counted by check_line
            stream.counts["refused"] += 1
            stream.bases.clear()
            await self._reply(stream, {"line": number, "status": exc.status, "detail": exc.detail})
            return
        try:
            snapshot = SnapshotDelta.model_validate_json(line)
            key = (snapshot.namespace, snapshot.run, snapshot.rank)
            write = StreamWrite(snapshot.changed, stream.bases.get(key))
            commands = self.accept(snapshot, write, stream.proof)
        except (ValidationError, NeedsWholeSnapshot) as exc:
            self.stats.count("pushes", "invalid")
            stream.counts["refused"] += 1
            problem = (invalid(exc.errors(include_url=False), ("body",)) if isinstance(exc, ValidationError)
                       else {"detail": str(exc)})
            stream.bases.clear()  # deltas after a refused line would build on the wrong base: whole lines first
            await self._reply(stream, {"line": number, "status": 422, **problem})
            return
        except Refused as exc:  # PushRefused (403) included; counted by accept
            stream.counts["refused"] += 1
            stream.bases.pop(key, None)
            await self._reply(stream, {"line": number, "status": exc.status, "detail": exc.detail})
            return
        if write.written is not None:  # what the line wrote, or would have had it not come late
            if key not in stream.bases and len(stream.bases) >= MAX_RANKS_PER_STREAM:
                stream.bases.pop(next(iter(stream.bases)))
            stream.bases[key] = write.written
        stream.counts["accepted"] += 1
        if commands:
            await self._reply(stream, {"run": snapshot.run, "rank": snapshot.rank, "seq": snapshot.seq,
                                       "commands": [c.model_dump(mode="json") for c in commands]})

    @staticmethod
    async def _reply(stream: _Stream, value: dict[str, Any]) -> None:
        if stream.open:
            await stream.send({"type": "http.response.body", "body": _json_line(value), "more_body": True})


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
