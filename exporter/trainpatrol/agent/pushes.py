"""The push route: ``POST /v1/push``, a rank's whole snapshot about once a second, on a kept-alive
connection; the reply carries the commands waiting for the rank.

The endpoint takes the ``Request``: the body is parsed by ``RankSnapshot.model_validate_json`` and the
reply written as bytes, without FastAPI's body parsing and response models, which cost more CPU
than the push itself. The OpenAPI schema documents the body through ``openapi_extra``.

A push is answered in this order: 401 without the token (pushes from other hosts) or with a wrong
one, before the body is read, so a wrong token costs no body (agent.auth.push_proof); 422 for another
Content-Type; 413 over ``max_push_bytes``; 413 for more samples than the bound, before parsing; 422
invalid; 403 for a run bound to another key or a namespace the token does not reach; 413/422/429
over a bound (agent.bounds).

Counts ``trainpatrol_pushes_total{outcome}`` (ok, invalid, unauthorized, wrong_namespace, wrong_run_key,
too_large, refused).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from ..protocol import Command, PushReply, RankSnapshot
from .auth import PushProof, push_proof
from .bounds import Refused
from .config import AgentConfig
from .problems import documented, invalid, read_body
from .stats import AgentStats

JSON = "application/json"
_EMPTY_REPLY = PushReply().model_dump_json().encode()
Accept = Callable[[RankSnapshot, PushProof], list[Command]]
"""Takes a valid snapshot in with what its request proved; returns the commands for the rank, or raises ``Refused``."""


def add_push_route(app: FastAPI, config: AgentConfig, stats: AgentStats, accept: Accept,
                   check_body: Callable[[bytes], None]) -> None:
    """``check_body`` raises ``Refused`` for a body over a bound before it is parsed (agent.bounds)."""
    limit = config.max_push_bytes

    def proof(request: Request) -> PushProof:
        try:
            proven = push_proof(request, config)
        except HTTPException:
            stats.count("pushes", "unauthorized")
            raise
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != JSON:
            stats.count("pushes", "invalid")
            raise HTTPException(422, f"Invalid request: body: Content-Type must be {JSON}, not {content_type!r}.")
        return proven

    @app.post("/v1/push", summary="One rank's snapshot", response_model=PushReply,
                 responses=documented(400, 401, 403, 413, 422, 429), openapi_extra=_body(JSON))
    async def push(request: Request) -> Response:
        proven = proof(request)
        body = await read_body(request, limit, lambda: stats.count("pushes", "too_large"))
        try:
            check_body(body)
            snapshot = RankSnapshot.model_validate_json(body)
            commands = accept(snapshot, proven)
        except ValidationError as exc:
            stats.count("pushes", "invalid")
            return JSONResponse(invalid(exc.errors(include_url=False), ("body",)), status_code=422)
        except Refused as exc:  # PushRefused (403) included; counted by check_body and accept
            return JSONResponse({"detail": exc.detail}, status_code=exc.status)
        reply = PushReply(commands=commands).model_dump_json().encode() if commands else _EMPTY_REPLY
        return Response(reply, media_type=JSON)


def _body(content_type: str) -> dict[str, Any]:
    """The request body of the push route, for OpenAPI: a RankSnapshot."""
    return {"requestBody": {"required": True, "content": {content_type: {"schema": _inlined(RankSnapshot)}}}}


def _inlined(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema with its definitions written where they are used: an operation's own
    schema cannot name the document's components, which hold only the models routes parse."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(definitions[node["$ref"].rsplit("/", 1)[1]])
            return {k: resolve(v) for k, v in node.items()}
        return [resolve(v) for v in node] if isinstance(node, list) else node

    return dict(resolve(schema))
