"""The agent's own counters.

Emits ``trainpatrol_agent_info``, ``trainpatrol_pushes_total{outcome}``,
``trainpatrol_webhook_alerts_total{outcome}``, ``trainpatrol_control_commands_total{action,source}``,
``trainpatrol_control_commands_refused_total{action,reason}``, ``trainpatrol_forwarded_alerts_total{outcome}``
and ``trainpatrol_refused_requests_total{reason}``.
"""

from __future__ import annotations

import functools
import socket
import threading
from collections import Counter
from collections.abc import Callable, Hashable

from prometheus_client.core import CounterMetricFamily, InfoMetricFamily, Metric
from prometheus_client.samples import Sample

from .._version import __version__
from ..agent.exposition import RenderedFamily, render, sample_line
from ..catalogue import BY_NAME

_COUNTERS = (("trainpatrol_pushes", "pushes", ["outcome"]), ("trainpatrol_webhook_alerts", "alerts", ["outcome"]),
             ("trainpatrol_forwarded_alerts", "forwarded", ["outcome"]),
             ("trainpatrol_control_commands", "commands", ["action", "source"]),
             ("trainpatrol_control_commands_refused", "refused", ["action", "reason"]),
             ("trainpatrol_refused_requests", "refusals", ["reason"]))
"""Family name, ``AgentStats`` attribute and label names of each counter, in exposition order."""


def _help(name: str) -> str:
    return BY_NAME[name].help


class AgentStats:
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._lock = threading.Lock()
        self.pushes: Counter[str] = Counter({"ok": 0, "invalid": 0, "unauthorized": 0, "wrong_namespace": 0,
                                              "wrong_run_key": 0, "too_large": 0})
        self.alerts: Counter[str] = Counter({"act": 0, "duplicate": 0, "resolved": 0, "forbidden": 0,
                                             "no_live_rank": 0, "coalesced": 0, "rate_limited": 0})
        self.commands: Counter[tuple[str, str]] = Counter()
        self.refused: Counter[tuple[str, str]] = Counter()
        self.forwarded: Counter[str] = Counter({"ok": 0, "failed": 0, "no_peer": 0})
        self.refusals: Counter[str] = Counter({"host": 0, "unauthorized": 0})
        """Requests, connections and pushes refused at the edge or over a bound, by reason (docs/security.md)."""
        self._rendered: dict[str, tuple[Hashable, RenderedFamily]] = {}
        self._version = 0
        """Counts made so far: the families stand while it and the host name stay the same."""
        self._collected: tuple[tuple[int, str], list[Metric]] | None = None

    def count(self, counter: str, key: str | tuple[str, str]) -> None:
        with self._lock:
            getattr(self, counter)[key] += 1
            self._version += 1

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        """The families; each is formatted again only when its values changed since the last scrape."""
        host = socket.gethostname()
        with self._lock:
            version = self._version
            collected = self._collected
            if collected is not None and collected[0] == (version, host):
                return collected[1]
            counts = [tuple(sorted(getattr(self, attr).items())) for _, attr, _ in _COUNTERS]
        info = self._family("trainpatrol_agent", (host, self.mode), functools.partial(_info, host, self.mode))
        out: list[Metric] = [info]
        for (name, _, labels), items in zip(_COUNTERS, counts, strict=True):
            out.append(self._family(name, items, functools.partial(_counter, name, labels, items)))
        self._collected = ((version, host), out)
        return out

    def _family(self, name: str, key: Hashable, build: Callable[[], RenderedFamily]) -> RenderedFamily:
        """The family served last time, or ``build()`` when its values (``key``) changed since."""
        cached = self._rendered.get(name)
        if cached is None or cached[0] != key:
            cached = self._rendered[name] = (key, build())
        return cached[1]


def _info(host: str, mode: str) -> RenderedFamily:
    info = InfoMetricFamily("trainpatrol_agent", _help("trainpatrol_agent_info"))
    info.add_metric([], {"version": __version__, "host": host, "mode": mode})
    return render([info])[0]


def _counter(name: str, labels: list[str], items: tuple[tuple[str | tuple[str, str], int], ...]) -> RenderedFamily:
    """A counter family, its lines written directly: pushes_total changes between most scrapes."""
    rows = [(list(key) if isinstance(key, tuple) else [str(key)], value) for key, value in items]

    def samples() -> list[Sample]:
        fam = CounterMetricFamily(name, _help(name + "_total"), labels=labels)
        for values, value in rows:
            fam.add_metric(values, value)
        return fam.samples
    text = "".join([sample_line(name + "_total", dict(zip(labels, values, strict=True)), value)
                    for values, value in rows])
    return RenderedFamily(name, _help(name + "_total"), "counter", "", text.encode(), samples)
