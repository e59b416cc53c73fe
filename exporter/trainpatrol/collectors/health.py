"""Runs named collectors so that one failing never fails the scrape, and writes the /metrics body.

Emits ``trainpatrol_collector_success{collector}`` and
``trainpatrol_collector_duration_seconds{collector}`` for each collector it runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from operator import is_
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from ..agent.exposition import Families, RenderedFamily, exposition, sample_line

log = logging.getLogger(__name__)


class Collects(Protocol):
    def collect(self) -> Iterable[Metric]: ...


class CollectorSet(Collector):
    """One registry entry for all collectors; each is timed and isolated."""

    def __init__(self, collectors: Mapping[str, Collects]) -> None:
        self._collectors = dict(collectors)
        self._logged: set[tuple[str, str]] = set()
        self._joined: dict[str, tuple[list[Metric], bytes]] = {}

    def describe(self) -> Iterable[Metric]:
        return []  # no collect() at registration: that would touch hardware at import time

    def collect(self) -> Iterator[Metric]:
        collected, health = self._run()
        for _, families in collected:
            yield from families
        yield from health

    def body(self) -> bytes:
        """``exposition`` of ``collect()``. A collector's families are joined into one part once, and
        that part is served while the collector returns the very same family objects: between two
        batches of pushes and two NVML samples, only the health gauges below are new."""
        collected, health = self._run()
        parts = []
        for name, families in collected:
            joined = self._joined.get(name)
            if joined is None or len(joined[0]) != len(families) or not all(map(is_, joined[0], families)):
                joined = self._joined[name] = (families, exposition(Families(families)))
            parts.append(joined[1])
        parts.append(exposition(Families(health)))
        return b"".join(parts)

    def _run(self) -> tuple[list[tuple[str, list[Metric]]], list[RenderedFamily]]:
        """Each collector's families, and the health gauges of this run."""
        collected: list[tuple[str, list[Metric]]] = []
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
            collected.append((name, families))
        return collected, [
            _gauge("trainpatrol_collector_success", "1 if the collector's last run succeeded.", "", success),
            _gauge("trainpatrol_collector_duration_seconds", "Duration of the collector's last run.", "seconds",
                   duration)]


def _gauge(name: str, help_: str, unit: str, values: list[tuple[str, float]]) -> RenderedFamily:
    """A gauge labelled ``collector``, its lines written directly: these change on every scrape."""
    def samples() -> list[Sample]:
        f = GaugeMetricFamily(name, help_, labels=["collector"], unit=unit)
        for collector, value in values:
            f.add_metric([collector], value)
        return f.samples
    text = "".join([sample_line(name, {"collector": collector}, value) for collector, value in values])
    return RenderedFamily(name, help_, "gauge", unit, text.encode(), samples)
