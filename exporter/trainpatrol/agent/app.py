"""The agent: its store, collectors, webhook handling and peer forwarder wired together (``Agent``), and its
routes on one FastAPI application (``build_api``), behind the Host check and token gate (agent.auth).

**Pushes** (``POST /v1/push``): a rank's whole snapshot about once a second on a kept-alive connection; the
reply carries the commands waiting for the rank. The route parses the body itself
(``RankSnapshot.model_validate_json``) and writes the reply as bytes, without FastAPI's body parsing and
response models. Answered in this order: 401 without the token (from other hosts) or with a wrong one,
before the body is read; 422 for another Content-Type; 413 over ``max_push_bytes``, then for more samples
than the bound, before parsing; 422 invalid; 403 for a run bound to another key or a namespace the token
does not reach; 413/422/429 over a bound (agent.limits). Counted in ``trainpatrol_pushes_total{outcome}``.

**Control.** A request answers at once (202): the command waits in the store for the ranks' next push. One
no rank could carry out is refused, nothing queued: 404 for a run no rank of which pushed here, 409 for one
whose ranks all closed, stopped or went down. The webhook applies the same rule alert by alert but answers
2xx (Alertmanager re-sends on 5xx and after a 4xx), outcome ``no_live_rank``; alerts for runs hosted
elsewhere go to the peer that hosts them (agent.peers). A run is (namespace, run):
``/v1/namespaces/{namespace}/runs/{run}/...``, or ``/v1/runs/{run}/...`` for the empty namespace. A command
of an action already queued and not yet acted on is coalesced into it (202, its id); checkpoints and
captures past the run's per-minute limit get 429.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Callable
from typing import Any, Literal

from fastapi import Body, FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .. import handshake
from .._version import __version__
from ..collectors.ranks import RankCollector
from ..collectors.registry import Collector, ProcessMetrics, Registry
from ..protocol import DNS_LABEL, RUN_PATTERN, ActionRequest, Command, PushReply, RankSnapshot, valid_run
from .alerts import WebhookPayload, Webhooks
from .auth import Edge, HostCheck, PushProof, push_proof, require_control
from .config import AgentConfig
from .limits import Bounds, PushRefused, Refused
from .peers import FORWARDED_HEADER, PeerForwarder
from .problems import BodyLimit, Problem, documented, invalid, no_live_rank, rate_limited, read_body
from .stats import AgentStats
from .store import Enqueued, RankStore, WrongRunKey

log = logging.getLogger(__name__)


class Agent:
    """Wires the store, collectors and peer forwarder together. ``app`` is the ASGI application: the Host
    check and token gate (agent.auth) in front of ``api``, the FastAPI application that serves every route."""

    def __init__(self, config: AgentConfig, nvml: Any = None, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.identity_key = secrets.token_hex(32)  # proves the agent to its user's ranks (trainpatrol.handshake)
        self.bounds = Bounds.of(config)
        self.stats = AgentStats(config.mode)
        self.store = RankStore(config.rank_up_ttl_seconds, config.rank_expire_seconds,
                               config.closed_expire_seconds, clock, action_limits=config.action_rate_limits,
                               bounds=self.bounds, squat_seconds=config.squat_seconds, count=self.stats.count)
        self.nvml = nvml
        collectors: dict[str, Collector] = {"ranks": RankCollector(self.store, level=config.series),
                                            "agent": self.stats, "process": ProcessMetrics()}
        if nvml is not None:
            collectors["nvml"] = nvml
        self.registry = Registry(collectors)
        self.peers = PeerForwarder(config, lambda outcome: self.stats.count("forwarded", outcome))
        self.webhooks = Webhooks(config, self.store, self.enqueue, self.peers.deliver,
                                 lambda outcome: self.stats.count("alerts", outcome), clock)
        self.alert_log = self.webhooks.log
        self.api = build_api(self)
        self.last_push = time.monotonic()  # a push, accepted or refused: scrapes and API calls keep no agent up
        self.app = Edge(self.api, hosts=HostCheck(config.host, config.allowed_hosts), stats=self.stats, config=config,
                        identity_key=self.identity_key)

    def accept_push(self, snapshot: RankSnapshot, proof: PushProof) -> list[Command]:
        """Store a valid push that ``proof`` allows; returns the commands for its reply. Raises, counted,
        ``PushRefused`` (403: a namespace out of the token's reach, a run bound to another key) or ``Refused``."""
        self.last_push = time.monotonic()  # a refused push too: its rank is alive, and an embedded agent stays up
        if not proof.scope.allows(snapshot.namespace):
            self.stats.count("pushes", "wrong_namespace")
            raise PushRefused(f"The token does not reach namespace {snapshot.namespace!r}.")
        try:
            self._check_gpu(snapshot)
            self.bounds.check_snapshot(snapshot)
            commands = self.store.push(snapshot, proof.key)
        except WrongRunKey as exc:
            self.stats.count("pushes", "wrong_run_key")
            raise PushRefused(str(exc)) from None
        except Refused as exc:
            self.stats.count("refusals", exc.reason)
            self.stats.count("pushes", "refused")
            raise
        self.stats.count("pushes", "ok")
        return commands

    def _check_gpu(self, snapshot: RankSnapshot) -> None:
        """A rank may name only a GPU of this node (read by NVML): claiming another one would put that GPU's
        alerts on its own run."""
        named = {snapshot.gpu_uuid, *(s.labels.get("gpu_uuid", "") for s in snapshot.samples
                                      if s.name == "trainpatrol_rank_info")} - {""}
        known = self.nvml.uuids() if self.nvml is not None and named else frozenset()
        foreign = sorted(named - known) if known else []
        if foreign:
            raise Refused(422, "foreign_gpu", f"GPU {foreign[0]!r} is not a GPU of this node "
                                              f"({len(known)} known by NVML); a rank pushes to its own node's agent.")

    def check_push_body(self, body: bytes) -> None:
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


class Hello(BaseModel):
    """A rank's challenge (trainpatrol.handshake): a fresh nonce, and which secret it holds."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    nonce: str = Field(pattern=r"^[0-9a-f]{16,128}$")
    with_: Literal["token", "key"] = Field(alias="with")


class HelloProof(BaseModel):
    proofs: list[str]
    """The nonce's HMAC under each secret of the kind asked for (the agent token, then namespace tokens)."""


class ActionAccepted(BaseModel):
    """The answer to an action: queued for the run's live ranks, who hear it with their next push."""

    accepted: bool
    id: int  # the command they will carry out: an earlier one of the same action when ``coalesced``
    run: str
    namespace: str = ""
    action: str
    coalesced: bool = False
    hosted: bool  # some rank of the run pushed here (always, when accepted)
    live: bool  # some rank pushed within the liveness TTL and neither closed nor stopped
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


JSON = "application/json"
_EMPTY_REPLY = PushReply().model_dump_json().encode()


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


def build_api(agent: Agent) -> FastAPI:
    """The FastAPI application that serves every route of ``agent``."""
    docs = agent.config.api_docs  # the schema maps the whole surface: only when asked for
    app = FastAPI(title="trainpatrol agent", version=__version__, openapi_url="/openapi.json" if docs else None,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  responses=documented(421),
                  # no OpenTelemetry of its own: its metrics are on /metrics, and the check costs every request
                  telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
                  description="Serves rank and GPU metrics to Prometheus and carries control actions "
                              "to training ranks. See docs/runbooks.md.")
    cfg = agent.config

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # a webhook or an action with fields out of bounds or not printable, say (a push answers its own 422)
        agent.stats.count("refusals", "invalid_request")
        return JSONResponse(invalid(exc.errors()), status_code=422)

    app.add_middleware(BodyLimit, limit=cfg.max_request_bytes,
                       refused=lambda: agent.stats.count("refusals", "max_request_bytes"))

    @app.post(handshake.PATH, summary="Proves to a rank that this is its agent, before it sends its secrets",
              response_model=HelloProof, responses={**documented(400, 422), 409: {"description": "No such secret"}})
    def hello(request: Request, body: Hello) -> HelloProof | JSONResponse:
        secrets_ = ([cfg.token, *cfg.namespace_tokens.values()] if body.with_ == "token"
                    else [agent.identity_key])
        secrets_ = [s for s in secrets_ if s]
        if not secrets_:
            return JSONResponse({"detail": f"This agent has no {body.with_} to prove itself with."}, status_code=409)
        client = handshake.client_part(request.client.host if request.client else "")
        port = (request.scope.get("server") or ("", cfg.port))[1]  # the port this connection reached
        return HelloProof(proofs=[handshake.proof(s, body.nonce, int(port), client) for s in secrets_])

    @app.get("/healthz", summary="Liveness and readiness", response_model=dict[str, Any])
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "mode": agent.config.mode, "version": __version__}

    @app.get("/metrics", summary="Prometheus exposition of all ranks and GPUs", response_class=Response)
    def metrics(request: Request) -> Response:
        # the text format, or OpenMetrics when the scraper asks for it (Prometheus does); gzip when accepted
        body = agent.registry.body(request.headers.get("accept", ""), request.headers.get("accept-encoding", ""))
        headers = ({"Content-Encoding": "gzip"} if body.gzipped else {}) | {"Vary": "Accept, Accept-Encoding"}
        return Response(body.data, media_type=body.content_type, headers=headers)

    @app.post("/v1/push", summary="One rank's snapshot", response_model=PushReply,
              responses=documented(400, 401, 403, 413, 422, 429),  # the body, which the route parses itself:
              openapi_extra={"requestBody": {"required": True, "content": {JSON: {"schema": _inlined(RankSnapshot)}}}})
    async def push(request: Request) -> Response:
        try:
            proven = push_proof(request, cfg)
        except HTTPException:
            agent.stats.count("pushes", "unauthorized")
            raise
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != JSON:
            agent.stats.count("pushes", "invalid")
            raise HTTPException(422, f"Invalid request: body: Content-Type must be {JSON}, not {content_type!r}.")
        body = await read_body(request, cfg.max_push_bytes, lambda: agent.stats.count("pushes", "too_large"))
        try:
            agent.check_push_body(body)  # raises Refused for a body over a bound before it is parsed
            snapshot = RankSnapshot.model_validate_json(body)
            commands = agent.accept_push(snapshot, proven)
        except ValidationError as exc:
            agent.stats.count("pushes", "invalid")
            return JSONResponse(invalid(exc.errors(include_url=False), ("body",)), status_code=422)
        except Refused as exc:  # PushRefused (403) included; counted by check_push_body and accept_push
            return JSONResponse({"detail": exc.detail}, status_code=exc.status)
        reply = PushReply(commands=commands).model_dump_json().encode() if commands else _EMPTY_REPLY
        return Response(reply, media_type=JSON)

    @app.get("/v1/runs", summary="Every run this agent hosts, with its ranks and last action",
             responses=documented(401))
    def runs() -> dict[str, Any]:
        return {"runs": agent.store.all_runs()}

    def status_of(namespace: str, run: str) -> dict[str, Any]:
        if not valid_run(run):
            raise HTTPException(422, f"Run name {run!r} is not valid; expected {RUN_PATTERN}.")
        status = agent.store.runs(namespace).get(run)
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
        live = agent.store.live_ranks(run, namespace)
        if not live:  # a queued command would wait for a rank that never comes: say so
            hosted = agent.store.hosts_run(run, namespace)
            state = agent.store.run_status(run, namespace=namespace)["state"] if hosted else "unknown"
            refusal = NoLiveRank(detail=no_live_rank(run, namespace), run=run, namespace=namespace, state=state)
            return JSONResponse(refusal.model_dump(exclude={"errors"}),
                                status_code=404 if state == "unknown" else 409)
        command = Command(id=secrets.randbelow(2**31 - 2) + 1, run=run, namespace=namespace, action=body.action,
                          reason=body.reason, source="api", created=agent.clock())
        try:
            outcome, standing = agent.enqueue(command)
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
        return agent.webhooks.handle(payload, scope, forwarded=request.headers.get(FORWARDED_HEADER) == "1")

    @app.get("/v1/alerts", summary="Recently received alerts and what was done with them",
             responses=documented(401))
    def alerts() -> dict[str, Any]:
        return {"alerts": list(agent.alert_log)}

    @app.get("/v1/nvml", summary="The last NVML sample, for evidence bundles", responses=documented(401))
    def nvml_snapshot() -> dict[str, Any]:
        if agent.nvml is None:
            return {"available": False, "reason": "NVML collector disabled"}
        try:
            return {"available": True, **agent.nvml.snapshot()}
        except Exception as exc:
            return {"available": False, "reason": str(exc)}

    return app
