"""The agent's HTTP surface: /metrics, pushes, the control API and the Alertmanager webhook.

Every control request answers at once (202) and acts asynchronously: commands wait in the store
and reach the ranks in the replies to their next push.
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
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .. import __version__
from ..collectors.agent_self import AgentStats
from ..collectors.health import CollectorSet, Collects
from ..collectors.ranks import RankCollector
from ..protocol import RUN_PATTERN, ActionRequest, Command, PushReply, RankSnapshot
from .alerts import Deduper, WebhookPayload, classify, to_command
from .auth import require_control, require_push
from .config import AgentConfig
from .router import FORWARDED_HEADER, Router
from .store import RankStore

log = logging.getLogger(__name__)


class Agent:
    """Wires the store, collectors and router together; ``app`` is the FastAPI application."""

    def __init__(self, config: AgentConfig, nvml: Any = None, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.store = RankStore(config.rank_up_ttl_seconds, config.rank_expire_seconds,
                               config.closed_expire_seconds, clock)
        self.stats = AgentStats(config.mode)
        self.nvml = nvml
        collectors: dict[str, Collects] = {"ranks": RankCollector(self.store), "agent": self.stats}
        if nvml is not None:
            collectors["nvml"] = nvml
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(CollectorSet(collectors))
        self.dedupe = Deduper(config.webhook_dedupe_size)
        self.router = Router(config, lambda outcome: self.stats.count("forwarded", outcome))
        self.alert_log: deque[dict[str, Any]] = deque(maxlen=200)
        self.app = self._build()

    def enqueue(self, command: Command) -> bool:
        fresh = self.store.enqueue(command)
        if fresh:
            self.stats.count("commands", (command.action, command.source.split(":")[0]))
            log.info("queued %s for run %s (id %d, %s): %s", command.action, command.run, command.id,
                     command.source, command.reason)
        return fresh

    def _build(self) -> FastAPI:
        app = FastAPI(title="trainpatrol agent", version=__version__,
                      description="Serves rank and GPU metrics to Prometheus and carries control actions "
                                  "to training ranks. See docs/runbooks.md.")
        cfg = self.config

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            if request.url.path == "/v1/push":
                self.stats.count("pushes", "invalid")
            errors = exc.errors()
            first = errors[0] if errors else {}
            where = ".".join(str(x) for x in first.get("loc", ()))
            message = f"Invalid request: {where}: {first.get('msg', 'malformed')}"
            return JSONResponse({"detail": message, "errors": jsonable_encoder(errors)}, status_code=422)

        @app.middleware("http")
        async def limit_body(request: Request, call_next: Callable[[Request], Any]) -> Any:
            length = request.headers.get("content-length", "0")
            if not length.isdigit() or int(length) > cfg.max_push_bytes:
                return JSONResponse({"detail": f"Request body of {length} bytes is over the limit of "
                                               f"{cfg.max_push_bytes} bytes."}, status_code=413)
            return await call_next(request)

        @app.get("/healthz", summary="Liveness and readiness")
        def healthz() -> dict[str, Any]:
            return {"status": "ok", "mode": cfg.mode, "version": __version__}

        @app.get("/metrics", summary="Prometheus exposition of all ranks and GPUs",
                 response_class=Response)
        def metrics() -> Response:
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        @app.post("/v1/push", response_model=PushReply, summary="One rank's snapshot",
                  responses={401: {"description": "Token required"}, 413: {"description": "Too large"}})
        def push(request: Request, snapshot: RankSnapshot) -> PushReply:
            try:
                require_push(request, cfg.token)
            except HTTPException:
                self.stats.count("pushes", "unauthorized")
                raise
            self.stats.count("pushes", "ok")
            return PushReply(commands=self.store.push(snapshot))

        @app.get("/v1/runs", summary="Every run this agent hosts, with its ranks and last action")
        def runs() -> dict[str, Any]:
            return {"runs": list(self.store.runs().values())}

        @app.get("/v1/runs/{run}", summary="One run's state, ranks, last action and checkpoint",
                 responses={404: {"description": "Unknown run"}})
        def run_status(run: str) -> dict[str, Any]:
            status = self.store.runs().get(run)
            if status is None:
                raise HTTPException(404, f"Run {run!r} is not hosted by this agent.")
            return status

        @app.post("/v1/runs/{run}/actions", status_code=202, summary="Ask every rank of a run to act",
                  responses={401: {"description": "Token required"}, 403: {"description": "Not allowed"},
                             422: {"description": "Malformed request"}})
        def act(request: Request, run: str, body: ActionRequest) -> dict[str, Any]:
            require_control(request, cfg.token)
            import re

            if not re.match(RUN_PATTERN, run):
                raise HTTPException(422, f"Run name {run!r} is not valid; expected {RUN_PATTERN}.")
            if body.action != "resume" and body.action not in cfg.allowed_actions:
                raise HTTPException(403, f"Action {body.action!r} is not in the allow-list "
                                         f"({', '.join(cfg.allowed_actions)}).")
            command = Command(id=secrets.randbelow(2**31 - 2) + 1, run=run, action=body.action,
                              reason=body.reason, source="api", created=self.clock())
            self.enqueue(command)
            return {"accepted": True, "id": command.id, "run": run, "action": body.action,
                    "hosted": self.store.hosts_run(run)}

        @app.post("/v1/alertmanager", status_code=202, summary="Alertmanager webhook (payload version 4)",
                  responses={401: {"description": "Token required"}, 403: {"description": "Action refused"},
                             422: {"description": "Malformed payload"}})
        def webhook(request: Request, payload: WebhookPayload = Body(...)) -> JSONResponse:  # noqa: B008
            require_control(request, cfg.token)
            forwarded = request.headers.get(FORWARDED_HEADER) == "1"
            results, refused, remote = [], [], []
            for alert in payload.alerts:
                kind = classify(alert, cfg.allowed_actions)
                fresh = self.dedupe.first_time(alert)
                name = alert.labels.get("alertname", "?")
                if not fresh:
                    kind = "duplicate"
                elif kind == "act":
                    command = to_command(alert, self.clock())
                    if self.store.hosts_run(command.run) or forwarded or not (cfg.peers or cfg.peers_dns):
                        self.enqueue(command)
                    else:
                        kind = "forwarded"
                        remote.append(alert)
                elif kind == "forbidden":
                    refused.append(f"{name}: action {alert.labels.get('action')!r}")
                self.stats.count("alerts", kind)
                record = {"alertname": name, "fingerprint": alert.fingerprint, "startsAt": alert.startsAt,
                          "status": alert.status, "run": alert.labels.get("run", ""),
                          "action": alert.labels.get("action", ""), "outcome": kind, "received": self.clock()}
                self.alert_log.append(record)
                results.append(record)
            if remote:
                self.router.forward(remote, payload.model_dump(exclude={"alerts"}))
            if refused:
                return JSONResponse({"detail": "Action not in the allow-list: " + "; ".join(refused),
                                     "results": results}, status_code=403)
            return JSONResponse({"accepted": True, "results": results}, status_code=202)

        @app.get("/v1/alerts", summary="Recently received alerts and what was done with them")
        def alerts() -> dict[str, Any]:
            return {"alerts": list(self.alert_log)}

        @app.get("/v1/nvml", summary="The last NVML sample, for evidence bundles")
        def nvml_snapshot() -> dict[str, Any]:
            if self.nvml is None:
                return {"available": False, "reason": "NVML collector disabled"}
            try:
                return {"available": True, **self.nvml.snapshot()}
            except Exception as exc:
                return {"available": False, "reason": str(exc)}

        return app
