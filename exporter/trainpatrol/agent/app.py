"""The agent: its store, collectors, webhook handling and peer forwarder wired together, behind the
Host check and token gate (agent.auth), serving the routes of agent.routes."""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..collectors.ranks import RankCollector
from ..collectors.registry import Collector, ProcessMetrics, Registry
from ..protocol import Command, RankSnapshot
from .alerts import Deduper, Webhooks
from .auth import Edge, HostCheck, PushProof
from .config import AgentConfig
from .limits import Bounds, PushRefused, Refused
from .peers import PeerForwarder
from .routes import build_api
from .stats import AgentStats
from .store import Enqueued, RankStore, WrongRunKey

log = logging.getLogger(__name__)


class Agent:
    """Wires the store, collectors and peer forwarder together. ``app`` is the ASGI application: the Host
    check and token gate (agent.auth) in front of ``api``, the FastAPI application that serves every route."""

    def __init__(self, config: AgentConfig, nvml: Any = None, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.identity_key = secrets.token_hex(32)
        """Proves this agent to its user's ranks when they have no token (trainpatrol.handshake); a
        loopback agent's server writes it to the user's key file."""
        self.bounds = Bounds.of(config)
        self.store = RankStore(config.rank_up_ttl_seconds, config.rank_expire_seconds,
                               config.closed_expire_seconds, clock, action_limits=config.action_rate_limits,
                               bounds=self.bounds, squat_seconds=config.squat_seconds,
                               count=lambda counter, reason: self.stats.count(counter, reason))
        self.stats = AgentStats(config.mode)
        self.nvml = nvml
        collectors: dict[str, Collector] = {"ranks": RankCollector(self.store, level=config.series),
                                            "agent": self.stats, "process": ProcessMetrics()}
        if nvml is not None:
            collectors["nvml"] = nvml
        self.registry = Registry(collectors)
        self.dedupe = Deduper(config.webhook_dedupe_size)
        self.peers = PeerForwarder(config, lambda outcome: self.stats.count("forwarded", outcome))
        self.alert_log: deque[dict[str, Any]] = deque(maxlen=config.alert_log_size)
        self.webhooks = Webhooks(config, self.store, self.enqueue, self.peers.deliver, self.dedupe, self.alert_log,
                                 lambda outcome: self.stats.count("alerts", outcome), clock)
        self.api = build_api(self)
        self.last_push = time.monotonic()
        """When a rank last pushed, accepted or refused (or the agent started): scrapes and API calls do not
        keep an idle agent up."""
        self.app = Edge(self.api, hosts=HostCheck(config.host, config.allowed_hosts), stats=self.stats, config=config)

    def accept_push(self, snapshot: RankSnapshot, proof: PushProof) -> list[Command]:
        """Store a valid push that ``proof`` allows; returns the commands for its reply. Raises
        ``PushRefused`` (403) for a namespace the token does not reach, or a run bound to another key,
        and ``Refused`` for a push over a bound, counted here."""
        self.last_push = time.monotonic()  # a refused push too: its rank is alive, and an embedded agent stays up
        if not proof.scope.allows(snapshot.namespace):
            self.stats.count("pushes", "wrong_namespace")
            raise PushRefused(f"The token does not reach namespace {snapshot.namespace!r}.")
        self._check_gpu(snapshot)
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
        self.stats.count("pushes", "ok")
        return commands

    def _check_gpu(self, snapshot: RankSnapshot) -> None:
        """A rank may name only a GPU of this node (read by NVML): a push that claims another run's GPU
        elsewhere, or one this node does not have, would put that GPU's alerts on its own run."""
        named = {snapshot.gpu_uuid, *(s.labels.get("gpu_uuid", "") for s in snapshot.samples
                                      if s.name == "trainpatrol_rank_info")} - {""}
        known = self.nvml.uuids() if self.nvml is not None and named else frozenset()
        foreign = sorted(named - known) if known else []
        if foreign:
            self.stats.count("refusals", "foreign_gpu")
            self.stats.count("pushes", "refused")
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
