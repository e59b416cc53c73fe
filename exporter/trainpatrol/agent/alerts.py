"""Alertmanager webhook payloads (version 4) and how an alert becomes a command."""

from __future__ import annotations

import zlib
from collections import OrderedDict
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..protocol import DNS_LABEL, RUN_PATTERN, Command


class Alert(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # strict: `false` is no integer
    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    startsAt: str
    endsAt: str = ""
    generatorURL: str = ""
    fingerprint: str = Field(min_length=1, max_length=64)


class WebhookPayload(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # strict: `false` is no integer
    version: Literal["4"]
    groupKey: str = ""
    truncatedAlerts: int = 0
    status: Literal["firing", "resolved"]
    receiver: str = ""
    groupLabels: dict[str, str] = Field(default_factory=dict)
    commonLabels: dict[str, str] = Field(default_factory=dict)
    commonAnnotations: dict[str, str] = Field(default_factory=dict)
    externalURL: str = ""
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
    import re

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
    if not re.match(RUN_PATTERN, run):
        return "bad_run"
    if not re.match(DNS_LABEL, alert.labels.get("namespace", "")):
        return "bad_namespace"
    return "act"
