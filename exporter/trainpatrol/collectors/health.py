"""Runs named collectors so that one failing never fails the scrape, and writes the /metrics body.

Emits ``trainpatrol_collector_success{collector}`` and
``trainpatrol_collector_duration_seconds{collector}`` for each collector it runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from operator import is_
from typing import Any, Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from ..agent.exposition import Families, RenderedFamily, exposition, sample_line

log = logging.getLogger(__name__)


class Collects(Protocol):
    def collect(self) -> Iterable[Metric]: ...


class CollectorSet(Collector):
    """One registry entry for all collectors; each is timed and isolated.

    A run of a collector that returns the very same family objects as its last run (a cache: no
    push, NVML sample or count since) found nothing new, and keeps the last run's success and
    duration. So between two batches of pushes and two NVML samples, the health gauges and the whole
    body stand as they are, and a scrape serves the same bytes without joining half a megabyte."""

    def __init__(self, collectors: Mapping[str, Collects]) -> None:
        self._collectors = dict(collectors)
        self._logged: set[tuple[str, str]] = set()
        self._runs: dict[str, _Run] = {}
        self._health: tuple[list[_Run], list[RenderedFamily]] = ([], [])
        self._body: tuple[list[_Run], bytes] = ([], b"")

    def describe(self) -> Iterable[Metric]:
        return []  # no collect() at registration: that would touch hardware at import time

    def collect(self) -> Iterator[Metric]:
        runs = self._run()
        for run in runs:
            yield from run.families
        yield from self._health_of(runs)

    def body(self) -> bytes:
        """``exposition`` of ``collect()``: each collector's families joined into one part once, and
        the whole body once per change of any collector."""
        runs = self._run()
        made_from, body = self._body
        if not _same(made_from, runs):
            parts = [run.joined() for run in runs]
            parts.append(exposition(Families(self._health_of(runs))))
            body = b"".join(parts)
            self._body = (runs, body)
        return body

    def _run(self) -> list[_Run]:
        """Each collector's run: a new one where it returned other families or failed anew."""
        runs = []
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
            last = self._runs.get(name)
            if last is None or last.ok != ok or not _same(last.families, families):
                last = self._runs[name] = _Run(name, families, ok, time.perf_counter() - start)
            runs.append(last)
        return runs

    def _health_of(self, runs: list[_Run]) -> list[RenderedFamily]:
        made_from, health = self._health
        if not _same(made_from, runs):
            health = [
                _gauge("trainpatrol_collector_success", "1 if the collector's last run succeeded.", "",
                       [(run.name, run.ok) for run in runs]),
                _gauge("trainpatrol_collector_duration_seconds",
                       "Duration of the collector's last run that found something new.", "seconds",
                       [(run.name, run.seconds) for run in runs])]
            self._health = (runs, health)
        return health


@dataclass(eq=False, slots=True)
class _Run:
    """What one run of a collector returned, and its families joined, made when the body needs them."""

    name: str
    families: list[Metric]
    ok: float
    seconds: float
    part: bytes | None = None

    def joined(self) -> bytes:
        if self.part is None:
            self.part = exposition(Families(self.families))
        return self.part


def _same(a: list[Any], b: list[Any]) -> bool:
    """The very same objects, in order."""
    return len(a) == len(b) and all(map(is_, a, b))


def _gauge(name: str, help_: str, unit: str, values: list[tuple[str, float]]) -> RenderedFamily:
    """A gauge labelled ``collector``, its lines written directly: these change on every scrape."""
    def samples() -> list[Sample]:
        f = GaugeMetricFamily(name, help_, labels=["collector"], unit=unit)
        for collector, value in values:
            f.add_metric([collector], value)
        return f.samples
    text = "".join([sample_line(name, {"collector": collector}, value) for collector, value in values])
    return RenderedFamily(name, help_, "gauge", unit, text.encode(), samples)
