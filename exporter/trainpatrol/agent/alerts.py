"""Alertmanager webhook payloads (version 4) and how an alert becomes a command."""

from __future__ import annotations

import re
import zlib
from collections import OrderedDict
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..protocol import DNS_LABEL, Command, Text, valid_run

Name = Annotated[Text, Field(max_length=256)]
Value = Annotated[Text, Field(max_length=1024)]
Labels = Annotated[dict[Name, Value], Field(max_length=64)]
Annotations = Annotated[dict[Name, Annotated[Text, Field(max_length=8192)]], Field(max_length=64)]
"""Bounded and printable: an alert's labels and annotations are stored (dedupe keys, the alert log, queued
commands), served back by /v1/alerts and /v1/runs, and printed. Alertmanager's own stay far below."""
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
