"""The agent's HTTP surface: /metrics, pushes, the control API and the Alertmanager webhook.

Every control request answers at once (202) and acts asynchronously: commands wait in the store
and reach the ranks in the replies to their next push. A command no rank could carry out is
refused instead: 404 for a run no rank of which ever pushed here, 409 for a run whose ranks all
closed, stopped or went down ("no live rank of run RUN on this agent"); nothing is queued then. The
webhook applies the same rule alert by alert, but answers 2xx (Alertmanager re-sends on 5xx and after
a 4xx): that alert's outcome is ``no_live_rank``, with the same message, and it is counted in
``trainpatrol_webhook_alerts_total{outcome="no_live_rank"}``. Alerts for runs this agent does not
host still go to the peer that does, when peers are configured (agent.router).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from fastapi import Body, FastAPI, HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from pydantic import BaseModel, Field
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import __version__
from ..collectors.agent_self import AgentStats
from ..collectors.health import CollectorSet, Collects
from ..collectors.process_self import ProcessMetrics
from ..collectors.ranks import RankCollector
from ..protocol import RUN_PATTERN, ActionRequest, Command, PushReply, RankSnapshot, valid_run
from .alerts import Deduper, WebhookPayload, classify, to_command
from .auth import require_control, require_push
from .bounds import Bounds, Refused
from .config import AgentConfig
from .edge import Edge, HostCheck
from .hotpath import HotPaths
from .problems import jsonable, shortened
from .router import FORWARDED_HEADER, Router
from .store import RankStore

log = logging.getLogger(__name__)


class Problem(BaseModel):
    """Every error answer: ``detail`` names the offending value; a 422 also lists each validation error."""

    detail: str
    errors: list[dict[str, Any]] = Field(default_factory=list)


class ActionAccepted(BaseModel):
    """The answer to an action: queued for the run's live ranks, who hear it with their next push."""

    accepted: bool
    id: int
    run: str
    action: str
    hosted: bool
    """Some rank of the run has pushed to this agent (always true when accepted)."""
    live: bool
    """Some rank of the run is live: it pushed within the liveness TTL and neither closed nor stopped."""
    live_ranks: int


class NoLiveRank(Problem):
    """404 or 409 from the actions route: no rank of the run could carry the command out."""

    run: str
    live: bool = False
    live_ranks: int = 0
    state: str
    """The run's state on this agent (``unknown`` when no rank of it pushed here)."""


_PROBLEMS = {400: "Body not readable (not UTF-8 JSON)", 401: "Token missing or wrong",
             403: "Action not in the allow-list", 404: "Unknown run", 413: "Request body too large",
             421: "Host header not one of this agent's names (agent.edge)", 422: "Malformed request",
             429: "Over one of the agent's bounds (agent.bounds)"}
_NO_LIVE_RANK: dict[int | str, dict[str, Any]] = {
    404: {"model": NoLiveRank, "description": "No rank of the run has pushed to this agent"},
    409: {"model": NoLiveRank, "description": "No rank of the run is live: all closed, stopped or down"}}


def no_live_rank(run: str) -> str:
    """The refusal of a command that no rank of ``run`` could carry out (the CLI prints it as it is)."""
    return f"no live rank of run {run} on this agent"


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for error answers, documented as they are sent (not FastAPI's default 422)."""
    return {code: {"model": Problem, "description": _PROBLEMS[code]} for code in codes}


class BodyLimit:
    """413 for a request body over ``limit`` bytes: by its Content-Length, or as a chunked body streams in.

    A plain ASGI middleware: Starlette's ``BaseHTTPMiddleware`` cost more CPU than a push itself.
    """

    def __init__(self, app: ASGIApp, limit: int, refused: Callable[[str], None] = lambda reason: None) -> None:
        self.app, self.limit, self.refused = app, limit, refused

    def _detail(self, length: str) -> str:
        return f"Request body of {length} bytes is over the limit of {self.limit} bytes."

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "0")
        if not length.isdigit() or int(length) > self.limit:
            self.refused("max_request_bytes")
            await JSONResponse({"detail": self._detail(length)}, status_code=413)(scope, receive, send)
            return
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:  # FastAPI re-raises an HTTPException from the body read as it is
                self.refused("max_request_bytes")
                raise HTTPException(413, self._detail(f"more than {self.limit}"))
            return message

        await self.app(scope, bounded, send)


class Agent:
    """Wires the store, collectors and router together. ``app`` is the ASGI application: the hot
    paths (agent.hotpath) in front of ``api``, the FastAPI application with everything else."""

    def __init__(self, config: AgentConfig, nvml: Any = None, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.bounds = Bounds(max_runs=config.max_runs, max_ranks_per_run=config.max_ranks_per_run,
                             max_series=config.max_series, max_samples_per_push=config.max_samples_per_push,
                             max_label_length=config.max_label_length,
                             max_queued_commands=config.max_queued_commands)
        self.store = RankStore(config.rank_up_ttl_seconds, config.rank_expire_seconds,
                               config.closed_expire_seconds, clock, bounds=self.bounds)
        self.stats = AgentStats(config.mode)
        self.nvml = nvml
        self.ranks = RankCollector(self.store)
        collectors: dict[str, Collects] = {"ranks": self.ranks, "agent": self.stats}
        collectors["process"] = ProcessMetrics()  # the agent's own process_* metrics, read once a second
        if nvml is not None:
            collectors["nvml"] = nvml
        self.registry = CollectorRegistry(auto_describe=False)
        self.collectors = CollectorSet(collectors)
        self.registry.register(self.collectors)
        self.dedupe = Deduper(config.webhook_dedupe_size)
        self.router = Router(config, lambda outcome: self.stats.count("forwarded", outcome))
        self.alert_log: deque[dict[str, Any]] = deque(maxlen=config.alert_log_size)
        self.api = self._build()
        self._scraped = False
        """A scrape came since the last batch of stream lines."""
        self.last_push = time.monotonic()
        """When a rank last pushed (or the agent started): scrapes and API calls do not keep an idle agent up."""
        hot = HotPaths(self.api, accept=self.accept_push, stats=self.stats, token=config.token,
                       max_body=config.max_push_bytes, metrics=self.metrics,
                       health=self._health, stream_idle_seconds=config.stream_idle_seconds,
                       after_batch=self._after_batch, check_body=self._check_push_body)
        self.app = Edge(hot, hosts=HostCheck(config.host, config.allowed_hosts), stats=self.stats,
                        token=config.token, metrics_token=config.metrics_token)

    def metrics(self) -> bytes:
        """The /metrics body."""
        self._scraped = True
        return self.collectors.body()

    def _after_batch(self) -> None:
        """Writes the new lines out right after a batch of stream lines, while they are in the
        caches and before a scrape waits for them, when scrapes come about as often as batches (a
        scrape came since the last one). With scrapes seconds apart, the next scrape does it."""
        if self._scraped:
            self._scraped = False
            self.collectors.body()

    def accept_push(self, snapshot: RankSnapshot, same_series_as: RankSnapshot | None = None) -> list[Command]:
        """Store a valid, authorised push and lay out its series; returns the commands for its reply.
        ``same_series_as``: a snapshot known to have the same series (a delta line's base).
        Raises ``Refused`` for a push over a bound, counted here."""
        try:
            if same_series_as is None:  # a delta's series were checked with its base
                self.bounds.check_snapshot(snapshot)
            commands = self.store.push(snapshot)
        except Refused as exc:
            self.stats.count("refusals", exc.reason)
            self.stats.count("pushes", "refused")
            raise
        self.last_push = time.monotonic()
        self.ranks.prepare(snapshot, same_series_as)
        self.stats.count("pushes", "ok")
        return commands

    def _check_push_body(self, body: bytes) -> None:
        """``Bounds.check_body``, counted."""
        try:
            self.bounds.check_body(body)
        except Refused as exc:
            self.stats.count("refusals", exc.reason)
            self.stats.count("pushes", "refused")
            raise

    def idle_for(self) -> float:
        """Seconds since a rank last pushed (or since the agent started)."""
        return time.monotonic() - self.last_push

    def _health(self) -> dict[str, Any]:
        return {"status": "ok", "mode": self.config.mode, "version": __version__}

    def enqueue(self, command: Command) -> bool:
        """Queue ``command``; False if it was queued before. Raises ``Refused`` over the queue's bound."""
        try:
            fresh = self.store.enqueue(command)
        except Refused as exc:
            self.stats.count("refusals", exc.reason)
            raise
        if fresh:
            self.stats.count("commands", (command.action, command.source.split(":")[0]))
            log.info("queued %s for run %s (id %d, %s): %s", command.action, command.run, command.id,
                     command.source, command.reason)
        return fresh

    def _build(self) -> FastAPI:
        docs = self.config.api_docs  # the schema maps the whole surface: only when asked for
        app = FastAPI(title="trainpatrol agent", version=__version__, openapi_url="/openapi.json" if docs else None,
                      docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                      responses=_errors(421),
                      description="Serves rank and GPU metrics to Prometheus and carries control actions "
                                  "to training ranks. See docs/runbooks.md.")
        cfg = self.config

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            if request.url.path == "/v1/push":
                self.stats.count("pushes", "invalid")
            else:  # a webhook or an action with fields out of bounds or not printable, say
                self.stats.count("refusals", "invalid_request")
            errors = shortened(list(exc.errors()))
            first = errors[0] if errors else {}
            where = ".".join(str(x) for x in first.get("loc", ()))
            message = f"Invalid request: {where}: {first.get('msg', 'malformed')}"
            # the input echoed may hold NaN or a lone surrogate, which JSONResponse cannot write
            return JSONResponse({"detail": message, "errors": jsonable(jsonable_encoder(errors))}, status_code=422)

        app.add_middleware(BodyLimit, limit=cfg.max_request_bytes,
                           refused=lambda reason: self.stats.count("refusals", reason))

        # /healthz, /metrics and /v1/push are answered by agent.hotpath before a request reaches
        # FastAPI; these routes document them in the OpenAPI schema, and answer HEAD
        @app.get("/healthz", summary="Liveness and readiness")
        async def healthz() -> dict[str, Any]:
            return self._health()

        @app.get("/metrics", summary="Prometheus exposition of all ranks and GPUs",
                 response_class=Response)
        async def metrics() -> Response:
            return Response(self.metrics(), media_type=CONTENT_TYPE_LATEST)

        @app.post("/v1/push", response_model=PushReply, summary="One rank's snapshot",
                  responses=_errors(400, 401, 413, 422, 429))
        async def push(request: Request, snapshot: RankSnapshot) -> PushReply:
            try:
                require_push(request, cfg.token)
            except HTTPException:
                self.stats.count("pushes", "unauthorized")
                raise
            try:
                return PushReply(commands=self.accept_push(snapshot))
            except Refused as exc:
                raise HTTPException(exc.status, exc.detail) from None

        @app.get("/v1/runs", summary="Every run this agent hosts, with its ranks and last action",
                 responses=_errors(401))
        def runs() -> dict[str, Any]:
            return {"runs": list(self.store.runs().values())}

        @app.get("/v1/runs/{run}", summary="One run's state, ranks, last action and checkpoint",
                 responses=_errors(401, 404, 422))
        def run_status(run: str) -> dict[str, Any]:
            if not valid_run(run):
                raise HTTPException(422, f"Run name {run!r} is not valid; expected {RUN_PATTERN}.")
            status = self.store.runs().get(run)
            if status is None:
                raise HTTPException(404, f"Run {run!r} is not hosted by this agent.")
            return status

        @app.post("/v1/runs/{run}/actions", status_code=202, summary="Ask every rank of a run to act",
                  response_model=ActionAccepted,
                  responses={**_errors(400, 401, 403, 413, 422, 429), **_NO_LIVE_RANK})
        def act(request: Request, run: str, body: ActionRequest) -> ActionAccepted | JSONResponse:
            require_control(request, cfg.token)
            if not valid_run(run):
                raise HTTPException(422, f"Run name {run!r} is not valid; expected {RUN_PATTERN}.")
            if body.action != "resume" and body.action not in cfg.allowed_actions:
                raise HTTPException(403, f"Action {body.action!r} is not in the allow-list "
                                         f"({', '.join(cfg.allowed_actions)}).")
            live = self.store.live_ranks(run)
            if not live:  # a queued command would wait for a rank that never comes: say so
                state = self.store.run_status(run)["state"] if self.store.hosts_run(run) else "unknown"
                refusal = NoLiveRank(detail=no_live_rank(run), run=run, state=state)
                return JSONResponse(refusal.model_dump(exclude={"errors"}),
                                    status_code=404 if state == "unknown" else 409)
            command = Command(id=secrets.randbelow(2**31 - 2) + 1, run=run, action=body.action,
                              reason=body.reason, source="api", created=self.clock())
            try:
                self.enqueue(command)
            except Refused as exc:
                return JSONResponse({"detail": exc.detail}, status_code=exc.status)
            return ActionAccepted(accepted=True, id=command.id, run=run, action=body.action, hosted=True,
                                  live=True, live_ranks=live)

        @app.post("/v1/alertmanager", status_code=202, summary="Alertmanager webhook (payload version 4)",
                  responses=_errors(400, 401, 403, 413, 422))
        def webhook(request: Request, payload: WebhookPayload = Body(...)) -> JSONResponse:  # noqa: B008
            require_control(request, cfg.token)
            forwarded = request.headers.get(FORWARDED_HEADER) == "1"
            results, refused, remote = [], [], []
            for alert in payload.alerts:
                kind = classify(alert, cfg.allowed_actions)
                fresh = self.dedupe.first_time(alert)
                name = alert.labels.get("alertname", "?")
                detail = ""
                if not fresh:
                    kind = "duplicate"
                elif kind == "act":
                    command = to_command(alert, self.clock())
                    if not (self.store.hosts_run(command.run) or forwarded or not (cfg.peers or cfg.peers_dns)):
                        kind = "forwarded"  # the router's case: a peer hosts the run
                        remote.append(alert)
                    elif self.store.live_ranks(command.run):
                        try:
                            self.enqueue(command)
                        except Refused as exc:  # not acted on: a re-send once the queue drains acts
                            kind, detail = "over_limit", exc.detail
                            self.dedupe.forget(alert)
                    else:  # a queued command would wait for a rank that never comes
                        kind, detail = "no_live_rank", no_live_rank(command.run)
                        self.dedupe.forget(alert)  # not acted on: a re-send once a rank is live acts
                elif kind == "forbidden":
                    refused.append(f"{name}: action {alert.labels.get('action')!r}")
                self.stats.count("alerts", kind)
                record = {"alertname": name, "fingerprint": alert.fingerprint, "startsAt": alert.startsAt,
                          "status": alert.status, "run": alert.labels.get("run", ""),
                          "action": alert.labels.get("action", ""), "outcome": kind, "received": self.clock()}
                if detail:
                    record["detail"] = detail
                self.alert_log.append(record)
                results.append(record)
            if remote:
                self.router.forward(remote, payload.model_dump(exclude={"alerts"}))
            if refused:
                return JSONResponse({"detail": "Action not in the allow-list: " + "; ".join(refused),
                                     "results": results}, status_code=403)
            return JSONResponse({"accepted": True, "results": results}, status_code=202)

        @app.get("/v1/alerts", summary="Recently received alerts and what was done with them",
                 responses=_errors(401))
        def alerts() -> dict[str, Any]:
            return {"alerts": list(self.alert_log)}

        @app.get("/v1/nvml", summary="The last NVML sample, for evidence bundles", responses=_errors(401))
        def nvml_snapshot() -> dict[str, Any]:
            if self.nvml is None:
                return {"available": False, "reason": "NVML collector disabled"}
            try:
                return {"available": True, **self.nvml.snapshot()}
            except Exception as exc:
                return {"available": False, "reason": str(exc)}

        _document_push_stream(app)
        return app


def _document_push_stream(app: FastAPI) -> None:
    """Adds ``POST /v1/push/stream`` (agent.push_stream) to the OpenAPI schema. Only the hot path
    serves it: a FastAPI route would have to read a body that never ends before it could answer."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()
        ndjson = {"application/x-ndjson": {"schema": {"$ref": "#/components/schemas/RankSnapshot"}}}
        schema["paths"].setdefault("/v1/push/stream", {"post": {
            "summary": "A rank's pushes on one kept-open request: a snapshot or delta per NDJSON line",
            "operationId": "push_stream",
            "description": "Answers 200 at once, then streams NDJSON: a line with the commands for a rank "
                           "after its snapshot, a line per refused input line, and a summary when the body "
                           "ends. See agent/push_stream.py.",
            "requestBody": {"required": True, "content": ndjson},
            "responses": {"200": {"description": "Streamed NDJSON answer",
                                  "content": {"application/x-ndjson": {"schema": {"type": "object"}}}},
                          **{str(code): {"description": _PROBLEMS[code], "content": {"application/json": {
                              "schema": {"$ref": "#/components/schemas/Problem"}}}} for code in (401, 422)}},
        }})
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
