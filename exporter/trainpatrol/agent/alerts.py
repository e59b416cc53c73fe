"""The Alertmanager webhook: its payloads (version 4), how an alert becomes a command, and ``Webhooks``,
which makes each alert a command for its (namespace, run) or delivers it to the peer hosting the run.

Idempotent on (fingerprint, startsAt): a duplicate answers 2xx. An alert that could not be acted on or
delivered (no live rank, rate-limited, a failed forward) is not marked seen, so Alertmanager's re-send is
handled again; a failed forward answers 503, which it re-sends at once (after a 4xx it would wait).
"""

from __future__ import annotations

import re
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..protocol import DNS_LABEL, Command, Text, valid_run
from .auth import Reach
from .config import AgentConfig
from .limits import Refused
from .problems import no_live_rank
from .store import Enqueued, RankStore

Name = Annotated[Text, Field(max_length=256)]
Value = Annotated[Text, Field(max_length=1024)]
Labels = Annotated[dict[Name, Value], Field(max_length=64)]
Annotations = Annotated[dict[Name, Annotated[Text, Field(max_length=8192)]], Field(max_length=64)]
"""Bounded and printable: they are stored, served back by /v1/alerts and /v1/runs, and printed."""
Url = Annotated[str, Field(max_length=4096)]


class Alert(BaseModel):
    # unknown fields are dropped, not kept: an alert's fields travel in its command (strict: `false` is no integer)
    model_config = ConfigDict(extra="ignore", strict=True)
    status: Literal["firing", "resolved"]
    labels: Labels
    annotations: Annotations = Field(default_factory=dict)
    startsAt: Annotated[Text, Field(max_length=64)]
    endsAt: Annotated[Text, Field(max_length=64)] = ""
    generatorURL: Url = ""
    fingerprint: Annotated[Text, Field(min_length=1, max_length=64)]


class WebhookPayload(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # strict: `false` is no integer
    version: Literal["4"]
    groupKey: Url = ""
    truncatedAlerts: int = Field(default=0, ge=0)
    status: Literal["firing", "resolved"]
    receiver: Name = ""
    groupLabels: Labels = Field(default_factory=dict)
    commonLabels: Labels = Field(default_factory=dict)
    commonAnnotations: Annotations = Field(default_factory=dict)
    externalURL: Url = ""
    alerts: list[Alert] = Field(max_length=1000)


def command_id(alert: Alert) -> int:
    """Stable across agents, so a rank that hears the same alert twice acts once."""
    return (zlib.crc32(f"{alert.fingerprint}|{alert.startsAt}".encode()) & 0x7FFFFFFE) + 1


def to_command(alert: Alert, now: float) -> Command:
    return Command(
        id=command_id(alert), run=alert.labels["run"], namespace=alert.labels.get("namespace", ""),
        action=alert.labels["action"],  # type: ignore[arg-type]
        reason=alert.annotations.get("summary", alert.labels.get("alertname", "")),
        source=f"alertmanager:{alert.labels.get('alertname', '?')}", created=now,
        alert=alert.model_dump(),
    )


class Deduper:
    """Remembers (fingerprint, startsAt) pairs already handled, bounded in size."""

    def __init__(self, size: int) -> None:
        self._seen: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self._size = size

    def first_time(self, alert: Alert) -> bool:
        key = (alert.fingerprint, alert.startsAt, alert.status)
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > self._size:
            self._seen.popitem(last=False)
        return True

    def forget(self, alert: Alert) -> None:
        """Unmark an alert that was not acted on, so that a re-send of it is handled again."""
        self._seen.pop((alert.fingerprint, alert.startsAt, alert.status), None)


def _began_before(alert: Alert, bound_at: float | None) -> bool:
    """The alert began before its run's key was bound, so from series not the run's (keyless pushes under its
    name); an unparsable time is not held against it."""
    if bound_at is None:
        return False
    text = re.sub(r"(\.\d{6})\d+", r"\1", alert.startsAt)  # Go writes nanoseconds; Python reads microseconds
    try:
        began = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return False
    return began.timestamp() < bound_at


def classify(alert: Alert, allowed: tuple[str, ...]) -> str:
    """One of: resolved, no_action, no_run, forbidden, bad_run, bad_namespace, act."""
    if alert.status == "resolved":
        return "resolved"
    action = alert.labels.get("action", "")
    if not action:
        return "no_action"
    if action not in allowed or action == "resume":
        return "forbidden"
    run = alert.labels.get("run", "")
    if not run:
        return "no_run"
    if not valid_run(run):
        return "bad_run"
    if not re.fullmatch(DNS_LABEL, alert.labels.get("namespace", "")):
        return "bad_namespace"
    return "act"


_FORGOTTEN = ("no_live_rank", "rate_limited", "over_limit", "forward_failed", "no_peer")
"""Outcomes of alerts not acted on: a re-send of one is handled again."""


class Webhooks:
    """``enqueue`` queues a command as the agent does (raises ``Refused`` over a bound); ``count(outcome)``
    counts an alert; ``log`` keeps the recent ones for ``GET /v1/alerts``."""

    def __init__(self, config: AgentConfig, store: RankStore, enqueue: Callable[[Command], tuple[Enqueued, Command]],
                 deliver: Callable[[list[Alert], dict[str, object]], list[str]], count: Callable[[str], None],
                 clock: Callable[[], float]) -> None:
        self.config, self.store, self.enqueue, self.deliver = config, store, enqueue, deliver
        self.count, self.clock = count, clock
        self.dedupe = Deduper(config.webhook_dedupe_size)
        self.log: deque[dict[str, Any]] = deque(maxlen=config.alert_log_size)

    def handle(self, payload: WebhookPayload, scope: Reach, *, forwarded: bool) -> JSONResponse:
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
                    kind = "forwarded"  # a peer hosts the run; settled below
                elif _began_before(alert, self.store.bound_at(command.run, namespace)):
                    kind = "predates_key"  # from series the run never pushed: a name squatted before it came
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
            delivered = self.deliver([a for a, _ in remote], payload.model_dump(exclude={"alerts"}))
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
