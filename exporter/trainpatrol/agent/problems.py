"""The agent's limits on request bodies and the words of its error answers: one place for every route.

- **413.** A body over its limit, at once by its Content-Length or as a chunked body streams in. The push
  checks its own limit once the token is checked, so a wrong token costs no body; ``BodyLimit`` holds
  every other route to ``max_request_bytes``.
- **422.** The first validation error in ``detail``, every one under ``errors`` with a ``loc`` that starts
  with ``body``; each echoed input cut to ``ECHO_CHARS``.
- Every error answer is a ``Problem``; ``documented`` gives a route's error codes for the OpenAPI schema.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PUSH_PATHS = frozenset({"/v1/push"})
ECHO_CHARS = 256
"""How much of a refused input an answer echoes: a hostile half-megabyte field would otherwise be
written back whole, and encoding it blocked the agent for longer than the refusal itself."""


class Problem(BaseModel):
    """Every error answer: ``detail`` names the offending value; a 422 also lists each validation error."""

    detail: str
    errors: list[dict[str, Any]] = Field(default_factory=list)


_DOCUMENTED = {400: "Body not readable (not UTF-8 JSON)", 401: "Token missing or wrong",
               403: "Action not in the allow-list, or a namespace the token does not reach", 404: "Unknown run",
               413: "Request body too large", 421: "Host header not one of this agent's names (agent.auth)",
               422: "Malformed request",
               429: "Over one of the agent's bounds (agent.limits), or the run's actions of this kind per minute "
                    "are used up (Retry-After)",
               503: "An alert for a run on a peer could not be delivered; Alertmanager re-sends it"}


def documented(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for error answers, documented as they are sent (not FastAPI's default 422)."""
    return {code: {"model": Problem, "description": _DOCUMENTED[code]} for code in codes}


class TooLarge(HTTPException):
    """413: FastAPI answers it as it answers any HTTPException, also when raised from a body read."""

    def __init__(self, length: str, limit: int) -> None:
        super().__init__(413, f"Request body of {length} bytes is over the limit of {limit} bytes.")


def limited(receive: Receive, length: str, limit: int, refused: Callable[[], None]) -> Receive:
    """``receive`` for a body of at most ``limit`` bytes, given its Content-Length header ("0" without
    one). Raises ``TooLarge``, once ``refused()`` counted it: at once by Content-Length, else when more came."""
    if not length.isdigit() or int(length) > limit:
        refused()
        raise TooLarge(length, limit)
    seen = 0

    async def bounded() -> Message:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            refused()
            raise TooLarge(f"more than {limit}", limit)
        return message

    return bounded


async def read_body(request: Request, limit: int, refused: Callable[[], None]) -> bytes:
    """The body of a push (``limited``); what came when the client went away early."""
    receive = limited(request.receive, request.headers.get("content-length", "0"), limit, refused)
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


class BodyLimit:
    """ASGI middleware: every route but the pushes takes a body of at most ``limit`` bytes (``limited``).
    Plain ASGI: Starlette's ``BaseHTTPMiddleware`` cost more CPU than a push itself."""

    def __init__(self, app: ASGIApp, limit: int, refused: Callable[[], None]) -> None:
        self.app, self.limit, self.refused = app, limit, refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # a GET or HEAD route reads no body; the pushes apply the limit themselves, after the token check
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD") and scope["path"] not in PUSH_PATHS:
            try:
                receive = limited(receive, Headers(scope=scope).get("content-length", "0"), self.limit, self.refused)
            except TooLarge as exc:
                await JSONResponse({"detail": exc.detail}, status_code=413)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def invalid(errors: Sequence[Any], loc: tuple[str, ...] = ()) -> dict[str, Any]:
    """A 422's body from pydantic's ``errors``, each ``loc`` prefixed with ``loc``."""
    shown = [jsonable({**e, "loc": [*loc, *e["loc"]]}) for e in shortened(errors)]
    first = shown[0] if shown else {}
    where = ".".join(str(x) for x in first.get("loc", ()))
    return {"detail": f"Invalid request: {where}: {first.get('msg', 'malformed')}", "errors": shown}


def shortened(errors: Sequence[Any]) -> list[Any]:
    """Validation errors with each echoed ``input`` cut to ``ECHO_CHARS`` of its text."""
    out = []
    for e in errors:
        e = {k: v for k, v in e.items() if k != "url"}
        value = e.get("input")
        text = value if isinstance(value, str) else None if isinstance(value, int | float | None) else repr(value)
        if text is not None and len(text) > ECHO_CHARS:
            e["input"] = text[:ECHO_CHARS] + f"... ({len(text)} characters)"
        out.append(e)
    return out


def jsonable(value: Any) -> Any:
    """``value`` as strict JSON can hold it: NaN, infinities and lone surrogates made text, as are bytes
    (maybe not UTF-8) and what else pydantic puts in an error (an exception in its ``ctx``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, int | float):
        return value
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, dict):
        return {jsonable(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return str(value).encode("utf-8", "backslashreplace").decode("utf-8")


def no_live_rank(run: str, namespace: str = "") -> str:
    """The refusal of a command that no rank of ``run`` could carry out (the CLI prints it as it is)."""
    return f"no live rank of run {run}{f' in namespace {namespace}' if namespace else ''} on this agent"


def rate_limited(run: str, namespace: str, action: str, limit: int) -> str:
    where = f" in namespace {namespace!r}" if namespace else ""
    return f"Run {run!r}{where} had {limit} {action} actions in the last 60 s, the limit; retry later."
