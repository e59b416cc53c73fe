"""Who may do what: tokens, the Host check, and the run keys that prove a push speaks for its run.

- **Tokens**, compared in constant time: the agent token reaches every namespace, a ``namespace_tokens``
  entry its namespace alone. Pushes from loopback need none.
- **The edge** (``Edge``, plain ASGI before any route). Every route answers only to loopback names, the
  bind address and ``allowed_hosts``; any other Host gets 421, so a DNS-rebound web page reaches nothing.
  With a token configured, every route but the push (checked by its route), ``/healthz`` and the hello
  needs it, reads included (runs, alerts and NVML name hosts, paths and commands); ``/metrics`` needs
  ``metrics_token`` when one is set. Without a token, requests that change state must come from loopback.
  It answers before the body is read, and counts refusals in ``trainpatrol_refused_requests_total``.
- **Run keys** (``RunKeys``). A rank proves its run's key (``X-Trainpatrol-Run-Key``, probe.run_key) with
  every push, its command acknowledgements included. The first keyed push of a (namespace, run) binds its
  key; then pushes without it are refused, so no other process can push as the run, mark its commands
  done or raise its alerts. A run whose pushes carry no key binds none (older probes). The agent keeps a
  digest, forgotten with the run's last series; a run whose ranks all ended takes the next key (a relaunch).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from fastapi import HTTPException, Request
from starlette.types import ASGIApp, Receive, Send
from starlette.types import Scope as AsgiScope

from ..handshake import is_loopback
from .config import AgentConfig
from .problems import PUSH_PATHS
from .stats import AgentStats

UNAUTHORIZED = "Missing or wrong bearer token."
LOOPBACK_ONLY = "No token is configured, so only loopback callers may use the control API."


@dataclass(frozen=True)
class Reach:
    """How far a token reaches: the namespaces a caller may act on or push into; ``None``: every one."""

    namespaces: frozenset[str] | None = None

    def allows(self, namespace: str) -> bool:
        return self.namespaces is None or namespace in self.namespaces


EVERY = Reach()


@dataclass(frozen=True)
class PushProof:
    """What a push request showed: the namespaces its token reaches, and the digest of its run key."""

    scope: Reach
    key: bytes


def bearer(authorization: str) -> str:
    """The token of an ``Authorization: Bearer <token>`` header value, else ""."""
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def token_ok(expected: str, presented: str) -> bool:
    """``presented`` as HTTP frameworks give a header: its bytes decoded as latin-1. Compared as the
    bytes that came, against the token's UTF-8, so a non-ASCII token matches."""
    try:
        raw = presented.encode("latin-1")
    except UnicodeEncodeError:  # not from a header: text as such
        raw = presented.encode("utf-8", "surrogateescape")
    return bool(expected) and hmac.compare_digest(expected.encode("utf-8"), raw)


def scope_of(config: AgentConfig, presented: str) -> Reach | None:
    """What a presented token reaches, or None for no valid token. Every entry is compared, so the
    time taken does not tell which one matched."""
    every = token_ok(config.token, presented)
    namespaces = frozenset(ns for ns, token in config.namespace_tokens.items() if token_ok(token, presented))
    if every:
        return EVERY
    return Reach(namespaces) if namespaces else None


def client_is_loopback(request: Request) -> bool:
    return request.client is not None and is_loopback(request.client.host)


def require_control(request: Request, config: AgentConfig) -> Reach:
    """Control and webhooks: a token when one is configured, else loopback callers only."""
    if config.token or config.namespace_tokens:
        scope = scope_of(config, bearer(request.headers.get("authorization", "")))
        if scope is None:
            raise HTTPException(401, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})
        return scope
    if not client_is_loopback(request):
        raise HTTPException(401, LOOPBACK_ONLY)
    return EVERY


PUSH_REFUSED = "Pushes from other hosts must carry the bearer token; a token that is sent must be right."


def push_proof(request: Request, config: AgentConfig) -> PushProof:
    """What a push proves, for the single route and the stream alike: pushes come from loopback
    without a token, or carry a right one (a wrong one is refused from loopback too); else 401."""
    presented = bearer(request.headers.get("authorization", ""))
    scope = EVERY if not presented and client_is_loopback(request) else scope_of(config, presented)
    if scope is None:
        raise HTTPException(401, PUSH_REFUSED, headers={"WWW-Authenticate": "Bearer"})
    return PushProof(scope, digest(request.headers.get(RUN_KEY_HEADER, "")))


RUN_KEY_HEADER = "x-trainpatrol-run-key"
RunId = tuple[str, str]
"""(namespace, run)."""


def digest(key: str) -> bytes:
    """Of the key as sent; empty for no key. The header is latin-1 on the wire, as ASGI gives it."""
    return hashlib.sha256(key.encode("latin-1", "replace")).digest() if key else b""


Binding = Literal["same", "bound", "rebound", "refused", "keyless"]
"""What a push's key does to its run: proves its key; binds one to a run that had none (its keyless ranks go)
or in place of another (its ranks go); is refused; or is a keyless push into a keyless run."""


class RunKeys:
    """Not thread-safe: RankStore calls it under its lock."""

    def __init__(self, remembered: int = 10_000) -> None:
        self._bound: dict[RunId, tuple[bytes, float]] = {}
        self._keyed: OrderedDict[RunId, None] = OrderedDict()  # the newest run names a keyed push used:
        # keyless pushes stay out of them for good, also after the keyed run's series expired
        self._remembered = remembered

    def admit(self, run: RunId, key_digest: bytes, replaceable: Callable[[RunId], bool], now: float) -> Binding:
        """Whether a push with this key may speak for ``run``. A keyed push binds a run that has no key
        (its keyless ranks go), or replaces the bound key when ``replaceable(run)`` says the run's
        ranks all ended or went down, or never trained (a relaunch, or a name squatted)."""
        bound = self._bound.get(run)
        if bound is not None and key_digest and hmac.compare_digest(bound[0], key_digest):
            return "same"
        if not key_digest:
            return "keyless" if bound is None and run not in self._keyed else "refused"
        if bound is None or replaceable(run):
            self._bound[run] = (key_digest, now)
            self._keyed[run] = None
            self._keyed.move_to_end(run)
            while len(self._keyed) > self._remembered:
                self._keyed.popitem(last=False)
            return "bound" if bound is None else "rebound"
        return "refused"

    def bound_at(self, run: RunId) -> float | None:
        """When the run's key was bound (agent clock); None for a run without one."""
        bound = self._bound.get(run)
        return bound[1] if bound is not None else None

    def keep_only(self, runs: set[RunId]) -> None:
        """Forget the keys of runs that have no series left (their names stay keyed)."""
        for run in [r for r in self._bound if r not in runs]:
            del self._bound[run]


OPEN = frozenset({"/healthz", "/v1/hello"})
"""Routes anyone may call: liveness, and the hello a rank opens with before it sends any secret."""
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def host_name(header: str) -> str | None:
    """The name in a Host header value (``name``, ``name:port``, ``[v6]:port``), lower-cased; None if malformed."""
    if header.startswith("["):
        name, _, rest = header[1:].partition("]")
        if rest and not rest.startswith(":"):
            return None
        port = rest[1:]
    else:
        name, _, port = header.partition(":")
    if (port and not (port.isdigit() and len(port) <= 5)) or not name or ":" in port:
        return None
    return name.lower()


class HostCheck:
    """Is a Host header value one of this agent's names? Answers are remembered: a few names repeat."""

    def __init__(self, bind_host: str, allowed: tuple[str, ...]) -> None:
        names = {_configured(h) for h in (*allowed, bind_host) if h.strip()}
        self.names = frozenset(n for n in names if n and n not in _WILDCARDS)
        self._known: dict[bytes, bool] = {}

    def __call__(self, header: bytes) -> bool:
        known = self._known.get(header)
        if known is None:
            known = self._decide(header.decode("latin-1"))
            if len(self._known) < 256:  # bounded: an attacker may send many names
                self._known[header] = known
        return known

    def _decide(self, header: str) -> bool:
        name = host_name(header)
        if name is None:
            return False
        if name in self.names or name == "localhost":
            return True
        try:
            ip = ipaddress.ip_address(name)
        except ValueError:
            return False
        return ip.is_loopback or str(ip) in self.names  # an IPv6 address may be written several ways


def _configured(entry: str) -> str:
    """A configured name or address as ``HostCheck`` compares it: an IP address (IPv6 with or without
    brackets) in its canonical form, a name lower-cased without a port."""
    try:
        return str(ipaddress.ip_address(entry.strip().strip("[]")))
    except ValueError:
        return host_name(entry.strip()) or ""


class Edge:
    """ASGI middleware: the Host check on every request, then the token gate (module docstring)."""

    def __init__(self, app: ASGIApp, *, hosts: HostCheck, stats: AgentStats, config: AgentConfig,
                 identity_key: str = "") -> None:
        self.app, self.hosts, self.stats = app, hosts, stats
        self.config, self.metrics_token = config, config.metrics_token
        self.identity_key = identity_key
        """The agent's key (trainpatrol.handshake), for a server that serves this to publish (tests/servers.py)."""

    async def __call__(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await _refuse(send, *refusal)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: AsgiScope) -> tuple[int, str, bool] | None:
        """(status, detail, ask for a bearer token) for a request refused here, else None."""
        host, authorization, hosts = b"", b"", 0
        for name, value in scope["headers"]:
            if name == b"host":
                host, hosts = value, hosts + 1
            elif name == b"authorization":
                authorization = value
        if hosts > 1:  # h11 keeps both and the last one won: a proxy in front may have checked the first
            self.stats.count("refusals", "host")
            return 400, "The request has more than one Host header: it is refused whatever they name.", False
        if not self.hosts(host):
            self.stats.count("refusals", "host")
            shown = host.decode("latin-1")
            return 421, (f"Host {shown!r} is not this agent's: DNS rebinding is refused. Add the name to "
                         "allowed_hosts (TRAINPATROL_ALLOWED_HOSTS) if it is one of ours."), False
        path = scope["path"]
        if path in PUSH_PATHS or path in OPEN:
            return None
        presented = bearer(authorization.decode("latin-1"))
        cfg = self.config
        if path == "/metrics":
            if not self.metrics_token or token_ok(self.metrics_token, presented):
                return None
        elif cfg.token or cfg.namespace_tokens:
            # reads list every namespace's runs and alerts: the agent's token only; a namespace's token
            # reaches that namespace's actions and webhooks, which their routes hold to it (agent.auth)
            reads = scope["method"] in ("GET", "HEAD")
            if token_ok(cfg.token, presented) if reads else scope_of(cfg, presented) is not None:
                return None
        else:
            client = scope.get("client")
            if scope["method"] in ("GET", "HEAD") or (client is not None and is_loopback(client[0])):
                return None
            self.stats.count("refusals", "unauthorized")
            return 401, LOOPBACK_ONLY, False
        self.stats.count("refusals", "unauthorized")
        return 401, UNAUTHORIZED, True


async def _refuse(send: Send, status: int, detail: str, challenge: bool) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    if challenge:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
