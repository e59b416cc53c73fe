"""Runs named collectors so that one failing never fails the scrape.

Emits ``trainpatrol_collector_success{collector}`` and
``trainpatrol_collector_duration_seconds{collector}`` for each collector it runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from ..agent.exposition import RenderedFamily, sample_line

log = logging.getLogger(__name__)


class Collects(Protocol):
    def collect(self) -> Iterable[Metric]: ...


class CollectorSet(Collector):
    """One registry entry for all collectors; each is timed and isolated."""

    def __init__(self, collectors: Mapping[str, Collects]) -> None:
        self._collectors = dict(collectors)
        self._logged: set[tuple[str, str]] = set()

    def describe(self) -> Iterable[Metric]:
        return []  # no collect() at registration: that would touch hardware at import time

    def collect(self) -> Iterator[Metric]:
        success: list[tuple[str, float]] = []
        duration: list[tuple[str, float]] = []
        for name, collector in self._collectors.items():
            start = time.perf_counter()
            try:
                families = list(collector.collect())
                ok = 1.0
            except Exception as exc:  # a broken collector must not break the scrape
                families, ok = [], 0.0
                key = (name, f"{type(exc).__name__}: {exc}")
                if key not in self._logged:
                    self._logged.add(key)
                    log.warning("collector %s failed: %s", name, key[1])
            success.append((name, ok))
            duration.append((name, time.perf_counter() - start))
            yield from families
        yield _gauge("trainpatrol_collector_success", "1 if the collector's last run succeeded.", "", success)
        yield _gauge("trainpatrol_collector_duration_seconds", "Duration of the collector's last run.", "seconds",
                     duration)


def _gauge(name: str, help_: str, unit: str, values: list[tuple[str, float]]) -> RenderedFamily:
    """A gauge labelled ``collector``, its lines written directly: these change on every scrape."""
    def samples() -> list[Sample]:
        f = GaugeMetricFamily(name, help_, labels=["collector"], unit=unit)
        for collector, value in values:
            f.add_metric([collector], value)
        return f.samples
    text = "".join([sample_line(name, {"collector": collector}, value) for collector, value in values])
    return RenderedFamily(name, help_, "gauge", unit, text.encode(), samples)
