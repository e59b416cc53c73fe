"""The requests that arrive many times a second, answered in plain ASGI before FastAPI.

Every rank pushes about once a second and Prometheus scrapes /metrics; at 64 ranks FastAPI's
routing, dependency solving and response models cost more CPU than the work itself (bench/scrape.py).
``HotPaths`` answers ``POST /v1/push``, ``POST /v1/push/stream`` (agent.push_stream), ``GET /metrics``
and ``GET /healthz`` directly and hands everything else to the FastAPI app, which still documents
these routes in its OpenAPI schema.
Answers are those FastAPI gave: 413 over the body limit, 401 without the token, 403 for a run bound
to another key (agent.run_keys), 422 with the validation errors under ``body``, 413/422/429 over a
bound (agent.bounds). One difference: the token is checked before the body is read, so a wrong token
costs no body.

Counts ``trainpatrol_pushes_total{outcome}`` (ok, invalid, unauthorized, wrong_namespace, wrong_run_key,
too_large, refused).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from ..protocol import PushReply, RankSnapshot
from .auth import PUSH_REFUSED, PushProof, push_scope
from .bounds import Refused
from .config import AgentConfig
from .problems import too_large, validation_problem
from .push_stream import NDJSON, Accept, PushStream
from .run_keys import RUN_KEY_HEADER, digest
from .stats import AgentStats

JSON = b"application/json"
_EMPTY_REPLY = PushReply().model_dump_json().encode()


class BodyTooLarge(Exception):
    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class HotPaths:
    """ASGI middleware: pushes, scrapes and health checks without the framework's per-request cost."""

    def __init__(self, app: ASGIApp, *, accept: Accept, stats: AgentStats,
                 config: AgentConfig, max_body: int, metrics: Callable[[], bytes],
                 health: Callable[[], dict[str, Any]], stream_idle_seconds: float,
                 after_batch: Callable[[], None] = lambda: None,
                 check_body: Callable[[bytes], None] = lambda body: None) -> None:
        self.app = app
        self.accept, self.stats = accept, stats
        self.config, self.max_body = config, max_body
        self.metrics, self.health = metrics, health
        self.check_body = check_body
        """Raises ``Refused`` for a body that is over a bound before it is parsed (agent.bounds)."""
        self.stream = PushStream(accept=accept, stats=stats, max_line=max_body, idle_seconds=stream_idle_seconds,
                                 after_batch=after_batch, check_line=check_body)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            method, path = scope["method"], scope["path"]
            if path == "/v1/push" and method == "POST":
                await self._push(scope, receive, send)
                return
            if path == "/v1/push/stream" and method == "POST":
                headers = dict(scope["headers"])
                proof = await self._proof(scope, headers, send, (NDJSON, JSON))
                if proof is not None:
                    await self.stream.serve(receive, send, proof)
                return
            if path == "/metrics" and method == "GET":
                await _answer(send, 200, self.metrics(), CONTENT_TYPE_LATEST.encode())
                return
            if path == "/healthz" and method == "GET":
                await _answer(send, 200, json.dumps(self.health()).encode(), JSON)
                return
        await self.app(scope, receive, send)

    async def _push(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"])
        proof = await self._proof(scope, headers, send, (JSON,))
        if proof is None:
            return
        try:
            body = await self._body(headers.get(b"content-length", b"0"), receive)
        except BodyTooLarge as exc:
            self.stats.count("pushes", "too_large")
            await _problem(send, 413, exc.detail)
            return
        try:
            self.check_body(body)
        except Refused as exc:
            await _problem(send, exc.status, exc.detail)
            return
        try:
            snapshot = RankSnapshot.model_validate_json(body)
        except ValidationError as exc:
            self.stats.count("pushes", "invalid")
            problem = validation_problem(exc)
            await _problem(send, 422, problem["detail"], errors=problem["errors"])
            return
        try:
            commands = self.accept(snapshot, None, proof)
        except Refused as exc:  # PushRefused (403) included; counted by accept
            await _problem(send, exc.status, exc.detail)
            return
        reply = PushReply(commands=commands).model_dump_json().encode() if commands else _EMPTY_REPLY
        await _answer(send, 200, reply, JSON)

    async def _proof(self, scope: Scope, headers: dict[bytes, bytes], send: Send,
                     content_types: tuple[bytes, ...]) -> PushProof | None:
        """What the request proves; None once it is answered 401 without the token (pushes from
        other hosts) or with a wrong one, or 422 for another Content-Type."""
        client = scope.get("client")
        allowed = push_scope(client[0] if client else None, headers.get(b"authorization", b"").decode("latin-1"),
                             self.config)
        if allowed is None:
            self.stats.count("pushes", "unauthorized")
            await _problem(send, 401, PUSH_REFUSED, [(b"www-authenticate", b"Bearer")])
            return None
        content_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if content_type not in content_types:
            self.stats.count("pushes", "invalid")
            wanted = " or ".join(t.decode() for t in content_types)
            await _problem(send, 422, f"Invalid request: body: Content-Type must be {wanted}, "
                                      f"not {content_type.decode('latin-1')!r}.")
            return None
        return PushProof(allowed, digest(headers.get(RUN_KEY_HEADER.encode(), b"").decode("latin-1")))

    async def _body(self, length: bytes, receive: Receive) -> bytes:
        """The request body; ``BodyTooLarge`` by Content-Length or as a chunked body streams in."""
        if not length.isdigit() or int(length) > self.max_body:
            raise BodyTooLarge(too_large(length.decode("latin-1"), self.max_body))
        chunks, seen, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body:
                raise BodyTooLarge(too_large(f"more than {self.max_body}", self.max_body))
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)


async def _answer(send: Send, status: int, body: bytes, content_type: bytes,
                  headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


async def _problem(send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None,
                   errors: list[dict[str, Any]] | None = None) -> None:
    problem: dict[str, Any] = {"detail": detail}
    if errors is not None:
        problem["errors"] = errors
    await _answer(send, status, json.dumps(problem).encode(), JSON, headers)
