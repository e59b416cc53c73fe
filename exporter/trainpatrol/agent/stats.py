"""The agent's own counters (``_COUNTERS``) and ``trainpatrol_agent_info``, and their part of /metrics."""

from __future__ import annotations

import socket
import threading
from collections import Counter
from collections.abc import Hashable, Iterator

from prometheus_client.metrics_core import CounterMetricFamily, InfoMetricFamily, Metric

from .._version import __version__
from ..catalogue import BY_NAME

_COUNTERS = (("trainpatrol_pushes_total", "pushes", ("outcome",)),
             ("trainpatrol_webhook_alerts_total", "alerts", ("outcome",)),
             ("trainpatrol_dropped_ranks_total", "dropped", ("reason",)),
             ("trainpatrol_forwarded_alerts_total", "forwarded", ("outcome",)),
             ("trainpatrol_control_commands_total", "commands", ("action", "source")),
             ("trainpatrol_control_commands_refused_total", "refused", ("action", "reason")),
             ("trainpatrol_refused_requests_total", "refusals", ("reason",)))
"""Family name, ``AgentStats`` attribute and label names of each counter, in exposition order."""


class AgentStats:
    """Thread-safe counts, and a collector of them (collectors.registry)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._lock = threading.Lock()
        self.pushes: Counter[str] = Counter({"ok": 0, "invalid": 0, "unauthorized": 0, "wrong_namespace": 0,
                                              "wrong_run_key": 0, "too_large": 0})
        self.alerts: Counter[str] = Counter({"act": 0, "duplicate": 0, "resolved": 0, "forbidden": 0,
                                             "no_live_rank": 0, "coalesced": 0, "rate_limited": 0,
                                             "predates_key": 0})
        self.dropped: Counter[str] = Counter({"keyless": 0, "superseded": 0, "evicted": 0})
        self.commands: Counter[tuple[str, str]] = Counter()
        self.refused: Counter[tuple[str, str]] = Counter()
        self.forwarded: Counter[str] = Counter({"ok": 0, "failed": 0, "no_peer": 0})
        self.refusals: Counter[str] = Counter({"host": 0, "unauthorized": 0})
        """Requests, connections and pushes refused at the edge or over a bound, by reason (docs/security.md)."""
        self._counts = 0

    def count(self, counter: str, key: str | tuple[str, str]) -> None:
        with self._lock:
            getattr(self, counter)[key] += 1
            self._counts += 1

    def version(self) -> Hashable:
        return self._counts, socket.gethostname()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts = [sorted(getattr(self, attr).items()) for _, attr, _ in _COUNTERS]
        info = InfoMetricFamily("trainpatrol_agent", BY_NAME["trainpatrol_agent_info"].help)
        info.add_metric([], {"host": socket.gethostname(), "mode": self.mode, "version": __version__})
        yield info
        for (name, _, labels), items in zip(_COUNTERS, counts, strict=True):
            family = CounterMetricFamily(name, BY_NAME[name].help, labels=labels)
            for key, n in items:
                family.add_metric(key if isinstance(key, tuple) else (key,), float(n))
            yield family
