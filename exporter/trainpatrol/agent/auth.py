"""Bearer-token checks: constant-time comparison, namespace scopes, loopback exemption for pushes only.

The agent token reaches every namespace; a ``namespace_tokens`` entry reaches its namespace alone.
Who may push into a run is decided apart from this, by the run's key (agent.run_keys)."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import HTTPException, Request

from .config import AgentConfig, is_loopback
from .run_keys import RUN_KEY_HEADER, digest


@dataclass(frozen=True)
class Scope:
    """The namespaces a caller may act on or push into; ``None``: every one."""

    namespaces: frozenset[str] | None = None

    def allows(self, namespace: str) -> bool:
        return self.namespaces is None or namespace in self.namespaces


EVERY = Scope()


@dataclass(frozen=True)
class PushProof:
    """What a push request showed: the namespaces its token reaches, and the digest of its run key."""

    scope: Scope
    key: bytes


def bearer(authorization: str) -> str:
    """The token of an ``Authorization: Bearer <token>`` header value, else ""."""
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def _presented(request: Request) -> str:
    return bearer(request.headers.get("authorization", ""))


def token_ok(expected: str, presented: str) -> bool:
    """``presented`` as HTTP frameworks give a header: its bytes decoded as latin-1. Compared as the
    bytes that came, against the token's UTF-8, so a non-ASCII token matches."""
    try:
        raw = presented.encode("latin-1")
    except UnicodeEncodeError:  # not from a header: text as such
        raw = presented.encode("utf-8", "surrogateescape")
    return bool(expected) and hmac.compare_digest(expected.encode("utf-8"), raw)


def scope_of(config: AgentConfig, presented: str) -> Scope | None:
    """What a presented token reaches, or None for no valid token. Every entry is compared, so the
    time taken does not tell which one matched."""
    every = token_ok(config.token, presented)
    namespaces = frozenset(ns for ns, token in config.namespace_tokens.items() if token_ok(token, presented))
    if every:
        return EVERY
    return Scope(namespaces) if namespaces else None


def client_is_loopback(request: Request) -> bool:
    return request.client is not None and is_loopback(request.client.host)


def require_control(request: Request, config: AgentConfig) -> Scope:
    """Control and webhooks: a token when one is configured, else loopback callers only."""
    if config.token or config.namespace_tokens:
        scope = scope_of(config, _presented(request))
        if scope is None:
            raise HTTPException(401, "Missing or wrong bearer token.", headers={"WWW-Authenticate": "Bearer"})
        return scope
    if not client_is_loopback(request):
        raise HTTPException(401, "No token is configured, so only loopback callers may use the control API.")
    return EVERY


PUSH_REFUSED = "Pushes from other hosts must carry the bearer token; a token that is sent must be right."


def push_proof(request: Request, config: AgentConfig) -> PushProof:
    """What a push proves, for the single route and the stream alike: pushes come from loopback
    without a token, or carry a right one (a wrong one is refused from loopback too); else 401."""
    presented = _presented(request)
    scope = EVERY if not presented and client_is_loopback(request) else scope_of(config, presented)
    if scope is None:
        raise HTTPException(401, PUSH_REFUSED, headers={"WWW-Authenticate": "Bearer"})
    return PushProof(scope, digest(request.headers.get(RUN_KEY_HEADER, "")))
