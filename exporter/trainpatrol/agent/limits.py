"""Every bound on what others make the agent hold or wait for (docs/security.md).

**What it holds** (``Bounds``). A push over a bound is refused whole, with the bound's name and setting in
the message, and counted in ``trainpatrol_refused_requests_total{reason}`` under that name. A bound refuses
only what is new (a run, a rank, more series), never the state of a rank that is here. ``ActionLimits``
bounds actions per run and minute.

**Connections** (``guarded_protocol``): what uvicorn lacks. uvicorn's own settings (agent/server.py) answer
400 to headers past ``max_header_bytes`` and close a connection idle after an answer, but set no timer
while a request is coming in, and accept connections until descriptors run out (``limit_concurrency``
closes none: it answers 503 to everything, /healthz too). Here a request's headers must be in within
``header_timeout`` of the connection opening (or of the request's first byte), its body within
``body_timeout`` of its headers, and over ``max_connections`` one connection is closed (``_victim``; the
policy and why it is that one are in docs/security.md). Each is counted in
``trainpatrol_refused_requests_total{reason}`` (header_timeout, body_timeout, connections; malformed for
uvicorn's 400). ``Guard`` wraps uvicorn's h11 protocol: it passes the ``asyncio.Protocol`` calls through and
reads h11's ``their_state`` after each, so no uvicorn method is overridden."""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import h11
from uvicorn import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from ..protocol import RankSnapshot
from .auth import RunId
from .config import AgentConfig

_DEFAULTS = AgentConfig()


class Refused(Exception):
    """A request over a bound: answered ``status`` with ``detail``, counted under ``reason``."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.reason, self.detail = status, reason, detail


class PushRefused(Refused):
    """A valid push its proof does not allow (403): a run bound to another key, a namespace out of the token's reach."""

    def __init__(self, detail: str) -> None:
        super().__init__(403, "run_key", detail)


def _setting(name: str) -> str:
    return f"{name}, TRAINPATROL_{name.upper()}"


@dataclass(frozen=True)
class Bounds:
    """The agent's bounds; their defaults and meaning are AgentConfig's."""

    max_runs: int = _DEFAULTS.max_runs
    max_ranks_per_run: int = _DEFAULTS.max_ranks_per_run
    max_series: int = _DEFAULTS.max_series
    max_series_per_run: int = _DEFAULTS.max_series_per_run
    max_samples_per_push: int = _DEFAULTS.max_samples_per_push
    max_label_length: int = _DEFAULTS.max_label_length
    max_queued_commands: int = _DEFAULTS.max_queued_commands

    @classmethod
    def of(cls, config: AgentConfig) -> Bounds:
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})

    def check_body(self, body: bytes) -> None:
        """Before parsing (10 ms per 0.25 MB of the event loop): every sample has a ``"name"`` key, bytes that
        cannot occur inside a JSON string, so their count bounds the samples from above."""
        found = body.count(b'"name"')
        if found > self.max_samples_per_push + 1:  # one more: the histogram has a name too
            raise Refused(413, "max_samples_per_push",
                          f"A push of at least {found - 1} samples is over the limit of {self.max_samples_per_push} "
                          f"({_setting('max_samples_per_push')}).")

    def check_snapshot(self, snap: RankSnapshot) -> None:
        """What one push may carry, whoever sends it."""
        if len(snap.samples) > self.max_samples_per_push:
            raise Refused(413, "max_samples_per_push",
                          f"A push of {len(snap.samples)} samples is over the limit of {self.max_samples_per_push} "
                          f"({_setting('max_samples_per_push')}).")
        if self.max_label_length < 256:  # the protocol already holds every label value to 256 characters
            for s in snap.samples:
                for name, value in s.labels.items():
                    if len(value) > self.max_label_length:
                        raise Refused(422, "max_label_length",
                                      f"Label {name!r} of {s.name} is {len(value)} characters long, over the limit "
                                      f"of {self.max_label_length} ({_setting('max_label_length')}).")

    def admit(self, snap: RankSnapshot, new_rank: bool, runs: int, ranks_of_run: int | None,
              series_after: int, run_series_after: int) -> None:
        """May the store take this push? ``ranks_of_run`` is None for a run it does not host yet."""
        if ranks_of_run is None and runs >= self.max_runs:
            raise Refused(429, "max_runs", f"Run {snap.run!r} refused: this agent already hosts {runs} runs, "
                                           f"the limit ({_setting('max_runs')}).")
        if new_rank and ranks_of_run is not None and ranks_of_run >= self.max_ranks_per_run:
            raise Refused(429, "max_ranks_per_run",
                          f"Rank {snap.rank} of run {snap.run!r} refused: the run already has {ranks_of_run} ranks "
                          f"here, the limit ({_setting('max_ranks_per_run')}).")
        if run_series_after > self.max_series_per_run:
            raise Refused(429, "max_series_per_run",
                          f"Push of run {snap.run!r} rank {snap.rank} refused: the run would hold {run_series_after} "
                          f"series, over the limit of {self.max_series_per_run} ({_setting('max_series_per_run')}).")
        if series_after > self.max_series:
            raise Refused(429, "max_series",
                          f"Push of run {snap.run!r} rank {snap.rank} refused: this agent would hold "
                          f"{series_after} series, over the limit of {self.max_series} ({_setting('max_series')}).")

    def admit_command(self, run: str, queued: int) -> None:
        if queued >= self.max_queued_commands:
            raise Refused(429, "max_queued_commands",
                          f"Run {run!r} already has {queued} commands waiting, the limit "
                          f"({_setting('max_queued_commands')}); they are carried out at the ranks' next push.")


WINDOW_SECONDS = 60.0


class ActionLimits:
    """Not thread-safe: RankStore calls it under its lock."""

    def __init__(self, limits: dict[str, int]) -> None:
        self.limits = dict(limits)
        self._times: dict[tuple[RunId, str], deque[float]] = {}

    def take(self, run: RunId, action: str, now: float) -> bool:
        """Counts one command of ``action`` for ``run`` at ``now`` unless the window is full."""
        limit = self.limits.get(action)
        if limit is None:
            return True
        times = self._times.setdefault((run, action), deque())
        while times and now - times[0] >= WINDOW_SECONDS:
            times.popleft()
        if len(times) >= limit:
            return False
        times.append(now)
        return True

    def expire(self, now: float) -> None:
        for key, times in list(self._times.items()):
            if not times or now - times[-1] >= WINDOW_SECONDS:
                del self._times[key]


log = logging.getLogger(__name__)


RECENT_SECONDS = 3.0
"""A connection that completed a request this recently is not evicted while one that never did is open."""


def _victim(live: set[Any], fresh: dict[Any, None], new: Any, now: float) -> Any:
    """The connection to close when ``new`` puts ``live`` over the cap (docs/security.md). ``fresh``: those
    that never completed a request, oldest first (O(1) under a flood that reconnects as fast as it is
    evicted); a connection's ``served`` is when its last request came in whole, ``busy`` that it is answered."""
    oldest = next(iter(fresh), new)  # ``new`` opened last: it comes first only when it is alone
    if oldest is not new:
        return oldest
    stale = [g for g in live if g is not new and not g.busy and g.served is not None
             and now - g.served > RECENT_SECONDS]
    if stale:
        return min(stale, key=lambda g: g.served)
    return new


def guarded_protocol(limits: AgentConfig, refused: Callable[[str], None]) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol under ``limits``; ``refused(reason)`` counts each connection let go."""
    live: set[Guard] = set()
    fresh: dict[Guard, None] = {}  # never completed a request, in the order they opened
    deadlines = {h11.IDLE: (limits.header_timeout_seconds, "header_timeout"),
                 h11.SEND_BODY: (limits.body_timeout_seconds, "body_timeout")}

    class Guard(asyncio.Protocol):
        def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                     _loop: asyncio.AbstractEventLoop | None = None) -> None:
            self.http = H11Protocol(config, server_state, app_state, _loop)
            self.served: float | None = None
            """When the last request came in whole; None before the first (``_victim``)."""
            self.timed: object = None
            """The peer's state whose deadline runs (or ran out, or has none)."""
            self.timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.http.connection_made(transport)  # type: ignore[arg-type]
            live.add(self)
            fresh[self] = None
            if len(live) > limits.max_connections:
                refused("connections")
                victim = _victim(live, fresh, self, self.http.loop.time())
                live.discard(victim)  # closing is not at once: the next connection must not pick it again
                fresh.pop(victim, None)
                victim.http.transport.close()
                if victim is self:
                    return
            self.watch()

        @property
        def busy(self) -> bool:
            return self.http.conn.their_state is h11.DONE

        def data_received(self, data: bytes) -> None:
            self.http.data_received(data)
            if self.busy:  # a request came in whole (also the next one of a kept-alive stream in one packet)
                self.served = self.http.loop.time()
                fresh.pop(self, None)
            self.watch()

        def connection_lost(self, exc: Exception | None) -> None:
            live.discard(self)
            fresh.pop(self, None)
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
