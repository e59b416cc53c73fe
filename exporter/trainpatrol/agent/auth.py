"""Bearer-token checks: constant-time comparison, loopback exemption for pushes only."""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request

from .config import is_loopback


def _presented(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def token_ok(expected: str, presented: str) -> bool:
    return bool(expected) and hmac.compare_digest(expected.encode(), presented.encode())


def client_is_loopback(request: Request) -> bool:
    return request.client is not None and is_loopback(request.client.host)


def require_control(request: Request, expected: str) -> None:
    """Control and webhooks: the token when one is configured, else loopback callers only."""
    if expected:
        if not token_ok(expected, _presented(request)):
            raise HTTPException(401, "Missing or wrong bearer token.", headers={"WWW-Authenticate": "Bearer"})
    elif not client_is_loopback(request):
        raise HTTPException(401, "No token is configured, so only loopback callers may use the control API.")


def require_push(request: Request, expected: str) -> None:
    """Pushes come from loopback or carry the token."""
    if client_is_loopback(request) and not _presented(request):
        return
    if not token_ok(expected, _presented(request)):
        raise HTTPException(401, "Pushes from other hosts must carry the bearer token.",
                            headers={"WWW-Authenticate": "Bearer"})
