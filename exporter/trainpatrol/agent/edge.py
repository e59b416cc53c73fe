"""The agent's front door, in plain ASGI before any route: the Host check and the token gate.

- **Host.** Every route answers only to loopback names (``localhost``, ``127.0.0.1``, ``[::1]``, any
  port), the bind address and ``allowed_hosts``; any other Host header gets 421. A web page whose
  name an attacker rebinds to 127.0.0.1 sends its own name as Host, so it reaches nothing.
- **Token.** With a token configured, every route but the pushes (agent.pushes checks those),
  ``/healthz`` and ``/metrics`` needs it: reads included, since runs, alerts and NVML name hosts,
  checkpoint paths and pending commands. ``/metrics`` needs ``metrics_token`` when one is set.
  Without a token (a loopback agent), requests that change state must come from loopback. Either
  way the answer comes before the body is read, so a wrong token costs no body and no validation.

Refusals are counted in ``trainpatrol_refused_requests_total{reason}`` (host, unauthorized).
"""

from __future__ import annotations

import ipaddress
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from .auth import bearer, scope_of, token_ok
from .config import AgentConfig, is_loopback
from .problems import PUSH_PATHS
from .stats import AgentStats

OPEN = frozenset({"/healthz"})
UNAUTHORIZED = "Missing or wrong bearer token."
LOOPBACK_ONLY = "No token is configured, so only loopback callers may use the control API."
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def host_name(header: str) -> str | None:
    """The name in a Host header value (``name``, ``name:port``, ``[v6]:port``), lower-cased; None if malformed."""
    if header.startswith("["):
        name, _, rest = header[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest
        if rest and not rest.startswith(":"):
            return None
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

    def __init__(self, app: ASGIApp, *, hosts: HostCheck, stats: AgentStats, config: AgentConfig) -> None:
        self.app, self.hosts, self.stats = app, hosts, stats
        self.config, self.metrics_token = config, config.metrics_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await _refuse(send, *refusal)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> tuple[int, str, bool] | None:
        """(status, detail, ask for a bearer token) for a request refused here, else None."""
        host, authorization = b"", b""
        for name, value in scope["headers"]:
            if name == b"host":
                host = value
            elif name == b"authorization":
                authorization = value
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
