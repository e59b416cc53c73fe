"""Connection limits uvicorn lacks: header and body timeouts, and a cap on open connections.

uvicorn closes a kept-alive connection that stays idle after a response, but not one that never
sends a request, sends its headers a byte at a time, or never finishes its body: about 1,100 such
connections under ``ulimit -n 1024`` made every new one fail, /healthz and scrapes included. Here:

- a request's headers must be in within ``header_timeout`` of the connection opening (or of the
  last response), and be at most ``max_header_bytes`` (httptools sets no limit); its body must be in
  within ``body_timeout`` of its headers; the push stream's body
  never ends, and its own idle timeout (agent.push_stream) lets a silent one go;
- over ``max_connections``, the connection that has sent nothing for longest is closed to make room,
  unless the agent is answering its request (then the next stalest; the new one when all are being
  answered). A flood of silent or slow connections thus gives way to the next scrape, and a rank's
  stream, which writes about once a second, is never the stalest.

Each is counted in ``trainpatrol_refused_requests_total{reason}`` (header_timeout, header_too_large,
body_timeout, connections). ``raise_open_files_limit`` lifts the soft RLIMIT_NOFILE to the hard one at start.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)
STREAM_PATH = "/v1/push/stream"


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 256
    header_timeout: float = 10.0
    body_timeout: float = 10.0
    max_header_bytes: int = 65_536


def guarded_protocol(limits: ConnectionLimits, refused: Callable[[str], None]) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with ``limits``; ``refused(reason)`` counts each connection let go."""

    class Guarded(HttpToolsProtocol):
        _timer: asyncio.TimerHandle | None = None
        _heard = 0.0
        """When the peer last sent something."""
        _answering = False
        """A whole request is in and the agent works on its answer."""
        _header_bytes: int | None = 0
        """Bytes received since the request began, while its headers are not complete (None after)."""
        _body_in = _answered = False
        """This request's body is all in; its answer is all out. The answer may come first (a 413 by
        Content-Length): the next request begins once both are done."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._heard = self.loop.time()
            if len(self.connections) > limits.max_connections:
                refused("connections")
                victim = min((c for c in self.connections if c is not self and not getattr(c, "_answering", True)),
                             key=lambda c: getattr(c, "_heard", 0.0), default=self)
                victim.transport.close()
                if victim is self:
                    return
            self._arm(limits.header_timeout, "header_timeout")

        def data_received(self, data: bytes) -> None:
            self._heard = self.loop.time()
            if self._header_bytes is not None:
                self._header_bytes += len(data)
            super().data_received(data)
            # still in the headers after parsing this chunk (a chunk that ends them sets None)
            if self._header_bytes is not None and self._header_bytes > limits.max_header_bytes \
                    and not self.transport.is_closing():
                refused("header_too_large")
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_headers_complete(self) -> None:
            self._disarm()
            self._header_bytes, self._body_in, self._answered = None, False, False
            super().on_headers_complete()
            if self.scope.get("path") != STREAM_PATH:
                self._arm(limits.body_timeout, "body_timeout")

        def on_message_complete(self) -> None:
            self._disarm()
            self._body_in = True
            if self._answered:
                self._next_request()
            else:
                self._answering = True
            super().on_message_complete()

        def on_response_complete(self) -> None:
            self._answered = True
            self._answering = False
            if self._body_in:
                self._next_request()
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm(limits.header_timeout, "header_timeout")

        def _next_request(self) -> None:
            self._header_bytes = 0

        def _arm(self, seconds: float, reason: str) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._expire, reason)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expire(self, reason: str) -> None:
            self._timer = None
            if not self.transport.is_closing():
                refused(reason)
                self.transport.close()

    return Guarded


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
