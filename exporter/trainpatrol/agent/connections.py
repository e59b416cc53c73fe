"""What uvicorn lacks: a deadline for a request to come in, and a cap on open connections.

uvicorn's own settings do the rest (agent/server.py): ``h11_max_incomplete_event_size`` answers 400
to headers past ``max_header_bytes``, ``timeout_keep_alive`` closes a connection left idle after an
answer. But uvicorn sets no timer while a request is coming in (not on a connection that opens and
sends nothing, nor while headers or a body trickle in), and it accepts connections until descriptors
run out; ``limit_concurrency`` closes none, it answers 503 to every request, /healthz too, once silent
connections fill it. About 1,100 such connections under ``ulimit -n 1024`` made every new one fail.
Here:

- a request must be in within ``header_timeout`` of the connection opening (or of its first byte
  after an answer; the silence before is ``timeout_keep_alive``'s), its body within
  ``body_timeout`` of its headers;
- over ``max_connections``, the connection that has sent nothing for longest is closed to make room,
  unless its request is in and being answered (then the next stalest; the new one when all are). A
  flood of silent or slow connections thus gives way to the next scrape, and a rank, which writes
  about once a second, is never the stalest.

Each is counted in ``trainpatrol_refused_requests_total{reason}`` (header_timeout, body_timeout,
connections; malformed for uvicorn's 400). ``Guard`` wraps uvicorn's h11 protocol rather than
subclassing it: it passes the ``asyncio.Protocol`` calls through and reads the parser's public state
(h11's ``their_state``) after each, so no uvicorn method is overridden.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 256
    header_timeout: float = 10.0
    body_timeout: float = 10.0


def guarded_protocol(limits: ConnectionLimits, refused: Callable[[str], None]) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol under ``limits``; ``refused(reason)`` counts each connection let go."""
    live: set[Guard] = set()
    deadlines = {h11.IDLE: (limits.header_timeout, "header_timeout"),
                 h11.SEND_BODY: (limits.body_timeout, "body_timeout")}

    class Guard(asyncio.Protocol):
        def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                     _loop: asyncio.AbstractEventLoop | None = None) -> None:
            self.http = H11Protocol(config, server_state, app_state, _loop)
            self.heard = self.http.loop.time()
            """When the peer last sent something."""
            self.timed: object = None
            """The peer's state whose deadline runs (or ran out, or has none)."""
            self.timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.http.connection_made(transport)  # type: ignore[arg-type]
            live.add(self)
            if len(live) > limits.max_connections:
                refused("connections")
                victim = min((g for g in live if g is not self and g.http.conn.their_state is not h11.DONE),
                             key=lambda g: g.heard, default=self)
                victim.http.transport.close()
                if victim is self:
                    return
            self.watch()

        def data_received(self, data: bytes) -> None:
            self.heard = self.http.loop.time()
            self.http.data_received(data)
            self.watch()

        def connection_lost(self, exc: Exception | None) -> None:
            live.discard(self)
            if self.timer is not None:
                self.timer.cancel()
            self.http.connection_lost(exc)

        def eof_received(self) -> None:
            self.http.eof_received()

        def pause_writing(self) -> None:
            self.http.pause_writing()

        def resume_writing(self) -> None:
            self.http.resume_writing()

        def watch(self) -> None:
            """(Re)starts the deadline when the peer's state changed: a request begun, its headers in."""
            state = self.http.conn.their_state
            if state is self.timed:
                return
            self.timed = state
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            if state is h11.ERROR:  # uvicorn answered 400 (headers past max_header_bytes, say) and closes
                refused("malformed")
            elif state in deadlines:
                seconds, reason = deadlines[state]
                self.timer = self.http.loop.call_later(seconds, self.expire, reason)

        def expire(self, reason: str) -> None:
            if not self.http.transport.is_closing():
                refused(reason)
                self.http.transport.close()

    return Guard


def raise_open_files_limit() -> int:
    """Lifts the soft limit on open files to the hard one (as far as the kernel allows); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, target, exc)
    return int(soft)
