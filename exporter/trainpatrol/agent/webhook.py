"""The Alertmanager webhook: each alert of a payload becomes a command for its (namespace, run), or is
delivered to the peer that hosts the run (agent.router).

Idempotent on (fingerprint, startsAt): a duplicate answers 2xx. An alert is marked seen only once it
was acted on or delivered to its peer; one that could not be (no live rank, rate-limited, a failed
forward) is forgotten, so Alertmanager's re-send is handled again. A failed forward answers 503, which
Alertmanager re-sends; after a 4xx it would wait a group_interval, and a 2xx ends it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

from ..protocol import Command
from .alerts import Alert, Deduper, WebhookPayload, classify, to_command
from .auth import Scope
from .bounds import Refused
from .config import AgentConfig
from .refusals import no_live_rank
from .router import Router
from .store import Enqueued, RankStore

_FORGOTTEN = ("no_live_rank", "rate_limited", "over_limit", "forward_failed", "no_peer")
"""Outcomes of alerts not acted on: a re-send of one is handled again."""


class Webhooks:
    """``enqueue`` queues a command as the agent does (raises ``Refused`` over a bound); ``count(outcome)``
    counts an alert; ``log`` keeps the recent ones for ``GET /v1/alerts``."""

    def __init__(self, config: AgentConfig, store: RankStore, enqueue: Callable[[Command], tuple[Enqueued, Command]],
                 router: Router, dedupe: Deduper, log: deque[dict[str, Any]], count: Callable[[str], None],
                 clock: Callable[[], float]) -> None:
        self.config, self.store, self.enqueue, self.router = config, store, enqueue, router
        self.dedupe, self.log, self.count, self.clock = dedupe, log, count, clock

    def handle(self, payload: WebhookPayload, scope: Scope, *, forwarded: bool) -> JSONResponse:
        cfg = self.config
        routing = bool(cfg.peers or cfg.peers_dns) and not forwarded
        results: list[dict[str, Any]] = []
        refused: list[str] = []
        remote: list[tuple[Alert, dict[str, Any]]] = []
        for alert in payload.alerts:
            kind = classify(alert, cfg.allowed_actions)
            namespace = alert.labels.get("namespace", "")
            name = alert.labels.get("alertname", "?")
            detail = ""
            if kind == "act" and not scope.allows(namespace):
                kind = "forbidden_namespace"  # not marked seen: the right token may send it yet
            elif not self.dedupe.first_time(alert):
                kind = "duplicate"
            elif kind == "act":
                command = to_command(alert, self.clock())
                if routing and not self.store.hosts_run(command.run, namespace):
                    kind = "forwarded"  # the router's case: a peer hosts the run; settled below
                elif self.store.live_ranks(command.run, namespace):
                    try:
                        enqueued, _ = self.enqueue(command)
                        kind = "act" if enqueued == "queued" else enqueued
                    except Refused as exc:  # not acted on: a re-send once the queue drains acts
                        kind, detail = "over_limit", exc.detail
                else:  # a queued command would wait for a rank that never comes
                    kind, detail = "no_live_rank", no_live_rank(command.run, namespace)
            elif kind == "forbidden":
                refused.append(f"{name}: action {alert.labels.get('action')!r}")
            record = {"alertname": name, "fingerprint": alert.fingerprint, "startsAt": alert.startsAt,
                      "status": alert.status, "namespace": namespace, "run": alert.labels.get("run", ""),
                      "action": alert.labels.get("action", ""), "outcome": kind, "received": self.clock()}
            if detail:
                record["detail"] = detail
            if kind == "forwarded":
                remote.append((alert, record))
            results.append(record)
        if remote:
            delivered = self.router.deliver([a for a, _ in remote], payload.model_dump(exclude={"alerts"}))
            for (_, record), outcome in zip(remote, delivered, strict=True):
                record["outcome"] = outcome
        for alert, record in zip(payload.alerts, results, strict=True):
            if record["outcome"] in _FORGOTTEN:
                self.dedupe.forget(alert)
            self.count(str(record["outcome"]))
            self.log.append(record)
        if refused:
            return JSONResponse({"detail": "Action not in the allow-list: " + "; ".join(refused),
                                 "results": results}, status_code=403)
        if any(r["outcome"] == "forward_failed" for r in results):
            return JSONResponse({"detail": "Some alerts could not be delivered to the agent hosting their run; "
                                           "re-send them.", "results": results}, status_code=503)
        return JSONResponse({"accepted": True, "results": results}, status_code=202)
