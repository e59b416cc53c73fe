"""The agent's HTTP surface: /metrics, pushes, the control API and the Alertmanager webhook.

Every control request answers at once (202) and acts asynchronously: commands wait in the store
and reach the ranks in the replies to their next push. A command no rank could carry out is
refused instead: 404 for a run no rank of which ever pushed here, 409 for a run whose ranks all
closed, stopped or went down ("no live rank of run RUN on this agent"); nothing is queued then. The
webhook applies the same rule alert by alert, but answers 2xx (Alertmanager re-sends on 5xx and after
a 4xx): that alert's outcome is ``no_live_rank``, with the same message, and it is counted in
``trainpatrol_webhook_alerts_total{outcome="no_live_rank"}``. Alerts for runs this agent does not
host still go to the peer that does, when peers are configured (agent.router; agent.webhook).

A run is (namespace, run): ``/v1/namespaces/{namespace}/runs/{run}/...``, and ``/v1/runs/{run}/...``
for the empty namespace. A command of an action that a queued one no rank acted on yet already asks
for is coalesced into it (202, its id); checkpoints and captures past the run's per-minute limit get
429. A push speaks only for the run whose key it proves (agent.run_keys); docs/security.md.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from fastapi import Body, FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from .._version import __version__
from ..collectors.process_self import ProcessMetrics
from ..collectors.ranks import RankCollector
from ..collectors.registry import Collector, Registry
from ..protocol import DNS_LABEL, RUN_PATTERN, ActionRequest, Command, RankSnapshot, valid_run
from .alerts import Deduper, WebhookPayload
from .auth import PushProof, require_control
from .bounds import Bounds, PushRefused, Refused
from .config import AgentConfig
from .edge import Edge, HostCheck
from .problems import BodyLimit, Problem, documented, invalid
from .pushes import add_push_route
from .refusals import no_live_rank, rate_limited
from .router import FORWARDED_HEADER, Router
from .stats import AgentStats
from .store import Enqueued, RankStore, WrongRunKey
from .webhook import Webhooks

log = logging.getLogger(__name__)


class ActionAccepted(BaseModel):
    """The answer to an action: queued for the run's live ranks, who hear it with their next push."""

    accepted: bool
    id: int
    """The command the ranks will carry out: an earlier one of the same action when ``coalesced``."""
    run: str
    namespace: str = ""
    action: str
    coalesced: bool = False
    """A command of the same action that no rank has acted on yet was queued before: it stands for this one."""
    hosted: bool
    """Some rank of the run has pushed to this agent (always true when accepted)."""
    live: bool
    """Some rank of the run is live: it pushed within the liveness TTL and neither closed nor stopped."""
    live_ranks: int


class NoLiveRank(Problem):
    """404 or 409 from the actions route: no rank of the run could carry the command out."""

    run: str
    namespace: str = ""
    live: bool = False
    live_ranks: int = 0
    state: str
    """The run's state on this agent (``unknown`` when no rank of it pushed here)."""


_NO_LIVE_RANK: dict[int | str, dict[str, Any]] = {
    404: {"model": NoLiveRank, "description": "No rank of the run has pushed to this agent"},
    409: {"model": NoLiveRank, "description": "No rank of the run is live: all closed, stopped or down"}}


class Agent:
    """Wires the store, collectors and router together. ``app`` is the ASGI application: the Host
    check and token gate (agent.edge) in front of ``api``, the FastAPI application that serves every route."""

    def __init__(self, config: AgentConfig, nvml: Any = None, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.bounds = Bounds.of(config)
        self.store = RankStore(config.rank_up_ttl_seconds, config.rank_expire_seconds,
                               config.closed_expire_seconds, clock, action_limits=config.action_rate_limits,
                               bounds=self.bounds)
        self.stats = AgentStats(config.mode)
        self.nvml = nvml
        collectors: dict[str, Collector] = {"ranks": RankCollector(self.store), "agent": self.stats,
                                            "process": ProcessMetrics()}
        if nvml is not None:
            collectors["nvml"] = nvml
        self.registry = Registry(collectors)
        self.dedupe = Deduper(config.webhook_dedupe_size)
        self.router = Router(config, lambda outcome: self.stats.count("forwarded", outcome))
        self.alert_log: deque[dict[str, Any]] = deque(maxlen=config.alert_log_size)
        self.webhooks = Webhooks(config, self.store, self.enqueue, self.router, self.dedupe, self.alert_log,
                                 lambda outcome: self.stats.count("alerts", outcome), clock)
        self.api = self._build()
        self.last_push = time.monotonic()
        """When a rank last pushed (or the agent started): scrapes and API calls do not keep an idle agent up."""
        self.app = Edge(self.api, hosts=HostCheck(config.host, config.allowed_hosts), stats=self.stats, config=config)

    def accept_push(self, snapshot: RankSnapshot, proof: PushProof) -> list[Command]:
        """Store a valid push that ``proof`` allows; returns the commands for its reply. Raises
        ``PushRefused`` (403) for a namespace the token does not reach, or a run bound to another key,
        and ``Refused`` for a push over a bound, counted here."""
        if not proof.scope.allows(snapshot.namespace):
            self.stats.count("pushes", "wrong_namespace")
            raise PushRefused(f"The token does not reach namespace {snapshot.namespace!r}.")
        try:
            self.bounds.check_snapshot(snapshot)
            commands = self.store.push(snapshot, proof.key)
        except WrongRunKey as exc:
            self.stats.count("pushes", "wrong_run_key")
            raise PushRefused(str(exc)) from None
        except Refused as exc:
            self.stats.count("refusals", exc.reason)
            self.stats.count("pushes", "refused")
            raise
        self.last_push = time.monotonic()
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

    def enqueue(self, command: Command) -> tuple[Enqueued, Command]:
        """Queue ``command`` (agent.store's outcomes); raises ``Refused`` over the queue's bound, counted."""
        try:
            outcome, standing = self.store.enqueue(command)
        except Refused as exc:
            self.stats.count("refusals", exc.reason)
            raise
        if outcome == "queued":
            self.stats.count("commands", (command.action, command.source.split(":")[0]))
            log.info("queued %s for run %s/%s (id %d, %s): %s", command.action, command.namespace, command.run,
                     command.id, command.source, command.reason)
        elif outcome in ("coalesced", "rate_limited"):
            self.stats.count("refused", (command.action, outcome))
        return outcome, standing

    def _build(self) -> FastAPI:
        docs = self.config.api_docs  # the schema maps the whole surface: only when asked for
        app = FastAPI(title="trainpatrol agent", version=__version__, openapi_url="/openapi.json" if docs else None,
                      docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                      responses=documented(421),
                      # no OpenTelemetry of its own: its metrics are on /metrics, and the check costs every request
                      telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
                      description="Serves rank and GPU metrics to Prometheus and carries control actions "
                                  "to training ranks. See docs/runbooks.md.")
        cfg = self.config

        @app.exception_handler(RequestValidationError)
        async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
            # a webhook or an action with fields out of bounds or not printable, say (pushes: agent.pushes)
            self.stats.count("refusals", "invalid_request")
            return JSONResponse(invalid(exc.errors()), status_code=422)

        app.add_middleware(BodyLimit, limit=cfg.max_request_bytes,
                           refused=lambda: self.stats.count("refusals", "max_request_bytes"))

        @app.get("/healthz", summary="Liveness and readiness", response_model=dict[str, Any])
        async def healthz() -> dict[str, Any]:
            return self._health()

        @app.get("/metrics", summary="Prometheus exposition of all ranks and GPUs", response_class=Response)
        def metrics(request: Request) -> Response:
            # the text format, or OpenMetrics when the scraper asks for it (Prometheus does); gzip when accepted
            body = self.registry.body(request.headers.get("accept", ""), request.headers.get("accept-encoding", ""))
            headers = {"Content-Encoding": "gzip", "Vary": "Accept, Accept-Encoding"} if body.gzipped else \
                {"Vary": "Accept, Accept-Encoding"}
            return Response(body.data, media_type=body.content_type, headers=headers)

        add_push_route(app, cfg, self.stats, self.accept_push, self._check_push_body)

        @app.get("/v1/runs", summary="Every run this agent hosts, with its ranks and last action",
                 responses=documented(401))
        def runs() -> dict[str, Any]:
            return {"runs": self.store.all_runs()}

        def status_of(namespace: str, run: str) -> dict[str, Any]:
            if not valid_run(run):
                raise HTTPException(422, f"Run name {run!r} is not valid; expected {RUN_PATTERN}.")
            status = self.store.runs(namespace).get(run)
            if status is None:
                where = f" in namespace {namespace!r}" if namespace else ""
                raise HTTPException(404, f"Run {run!r}{where} is not hosted by this agent.")
            return status

        @app.get("/v1/runs/{run}", summary="One run's state, ranks, last action and checkpoint (empty namespace)",
                 responses=documented(401, 404, 422))
        def run_status(run: str) -> dict[str, Any]:
            return status_of("", run)

        @app.get("/v1/namespaces/{namespace}/runs/{run}", summary="One run of a namespace: state, ranks, last action",
                 responses=documented(401, 404, 422))
        def namespaced_run_status(namespace: str, run: str) -> dict[str, Any]:
            return status_of(namespace, run)

        def act(request: Request, namespace: str, run: str, body: ActionRequest) -> ActionAccepted | JSONResponse:
            scope = require_control(request, cfg)
            if not valid_run(run):
                raise HTTPException(422, f"Run name {run!r} is not valid; expected {RUN_PATTERN}.")
            if not re.fullmatch(DNS_LABEL, namespace):
                raise HTTPException(422, f"Namespace {namespace!r} is not valid; expected a DNS label.")
            if not scope.allows(namespace):
                raise HTTPException(403, f"The token does not reach namespace {namespace!r}.")
            if body.action != "resume" and body.action not in cfg.allowed_actions:
                raise HTTPException(403, f"Action {body.action!r} is not in the allow-list "
                                         f"({', '.join(cfg.allowed_actions)}).")
            live = self.store.live_ranks(run, namespace)
            if not live:  # a queued command would wait for a rank that never comes: say so
                hosted = self.store.hosts_run(run, namespace)
                state = self.store.run_status(run, namespace=namespace)["state"] if hosted else "unknown"
                refusal = NoLiveRank(detail=no_live_rank(run, namespace), run=run, namespace=namespace, state=state)
                return JSONResponse(refusal.model_dump(exclude={"errors"}),
                                    status_code=404 if state == "unknown" else 409)
            command = Command(id=secrets.randbelow(2**31 - 2) + 1, run=run, namespace=namespace, action=body.action,
                              reason=body.reason, source="api", created=self.clock())
            try:
                outcome, standing = self.enqueue(command)
            except Refused as exc:
                return JSONResponse({"detail": exc.detail}, status_code=exc.status)
            if outcome == "rate_limited":
                limit = cfg.action_rate_limits[body.action]
                return JSONResponse({"detail": rate_limited(run, namespace, body.action, limit)}, status_code=429,
                                    headers={"Retry-After": "60"})
            return ActionAccepted(accepted=True, id=standing.id, run=run, namespace=namespace, action=body.action,
                                  coalesced=outcome == "coalesced", hosted=True, live=True, live_ranks=live)

        action_responses = {**documented(400, 401, 403, 413, 422, 429), **_NO_LIVE_RANK}

        @app.post("/v1/runs/{run}/actions", status_code=202, summary="Ask every rank of a run to act (empty namespace)",
                  response_model=ActionAccepted, responses=action_responses)
        def run_action(request: Request, run: str, body: ActionRequest) -> ActionAccepted | JSONResponse:
            return act(request, "", run, body)

        @app.post("/v1/namespaces/{namespace}/runs/{run}/actions", status_code=202,
                  summary="Ask every rank of a run of a namespace to act", response_model=ActionAccepted,
                  responses=action_responses)
        def namespaced_run_action(request: Request, namespace: str, run: str,
                                  body: ActionRequest) -> ActionAccepted | JSONResponse:
            return act(request, namespace, run, body)

        @app.post("/v1/alertmanager", status_code=202, summary="Alertmanager webhook (payload version 4)",
                  responses=documented(400, 401, 403, 413, 422, 503))
        def webhook(request: Request, payload: WebhookPayload = Body(...)) -> JSONResponse:  # noqa: B008
            scope = require_control(request, cfg)
            return self.webhooks.handle(payload, scope, forwarded=request.headers.get(FORWARDED_HEADER) == "1")

        @app.get("/v1/alerts", summary="Recently received alerts and what was done with them",
                 responses=documented(401))
        def alerts() -> dict[str, Any]:
            return {"alerts": list(self.alert_log)}

        @app.get("/v1/nvml", summary="The last NVML sample, for evidence bundles", responses=documented(401))
        def nvml_snapshot() -> dict[str, Any]:
            if self.nvml is None:
                return {"available": False, "reason": "NVML collector disabled"}
            try:
                return {"available": True, **self.nvml.snapshot()}
            except Exception as exc:
                return {"available": False, "reason": str(exc)}

        return app
