"""The agent's own counters.

Emits ``trainpatrol_agent_info``, ``trainpatrol_pushes_total{outcome}``,
``trainpatrol_webhook_alerts_total{outcome}``, ``trainpatrol_control_commands_total{action,source}``
and ``trainpatrol_forwarded_alerts_total{outcome}``.
"""

from __future__ import annotations

import socket
import threading
from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, InfoMetricFamily, Metric

from .. import __version__
from ..catalogue import BY_NAME


def _help(name: str) -> str:
    return BY_NAME[name].help


class AgentStats:
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._lock = threading.Lock()
        self.pushes: Counter[str] = Counter({"ok": 0, "invalid": 0, "unauthorized": 0, "too_large": 0})
        self.alerts: Counter[str] = Counter({"act": 0, "duplicate": 0, "resolved": 0, "forbidden": 0})
        self.commands: Counter[tuple[str, str]] = Counter()
        self.forwarded: Counter[str] = Counter({"ok": 0, "failed": 0, "no_peer": 0})

    def count(self, counter: str, key: str | tuple[str, str]) -> None:
        with self._lock:
            getattr(self, counter)[key] += 1

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        info = InfoMetricFamily("trainpatrol_agent", _help("trainpatrol_agent_info"))
        info.add_metric([], {"version": __version__, "host": socket.gethostname(), "mode": self.mode})
        yield info
        with self._lock:
            for name, counter in (("trainpatrol_pushes", self.pushes), ("trainpatrol_webhook_alerts", self.alerts),
                                  ("trainpatrol_forwarded_alerts", self.forwarded)):
                fam = CounterMetricFamily(name, _help(name + "_total"), labels=["outcome"])
                for key, value in sorted(counter.items()):
                    fam.add_metric([str(key)], value)
                yield fam
            fam = CounterMetricFamily("trainpatrol_control_commands", _help("trainpatrol_control_commands_total"),
                                      labels=["action", "source"])
            for (action, source), value in sorted(self.commands.items()):
                fam.add_metric([action, source], value)
            yield fam
