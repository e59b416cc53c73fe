"""Bearer-token checks: constant-time comparison, loopback exemption for pushes only."""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request

from .config import is_loopback


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


def client_is_loopback(request: Request) -> bool:
    return request.client is not None and is_loopback(request.client.host)


def require_control(request: Request, expected: str) -> None:
    """Control and webhooks: the token when one is configured, else loopback callers only."""
    if expected:
        if not token_ok(expected, _presented(request)):
            raise HTTPException(401, "Missing or wrong bearer token.", headers={"WWW-Authenticate": "Bearer"})
    elif not client_is_loopback(request):
        raise HTTPException(401, "No token is configured, so only loopback callers may use the control API.")


PUSH_REFUSED = "Pushes from other hosts must carry the bearer token."


def push_allowed(client_host: str | None, authorization: str, expected: str) -> bool:
    """Pushes come from loopback without a token, or carry the right one."""
    presented = bearer(authorization)
    if client_host is not None and is_loopback(client_host) and not presented:
        return True
    return token_ok(expected, presented)


def require_push(request: Request, expected: str) -> None:
    host = request.client.host if request.client is not None else None
    if not push_allowed(host, request.headers.get("authorization", ""), expected):
        raise HTTPException(401, PUSH_REFUSED, headers={"WWW-Authenticate": "Bearer"})
