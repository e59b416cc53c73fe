"""The agent's registry: named collectors, their health, and the /metrics body in the format asked for.

Each collector is a prometheus_client collector (``collect()``) that also says, cheaply, when it would
give something new (``version()``). A collector is collected again only when its version moved, a
failing one gives nothing and fails no scrape, and the body is written once per format for each
state of the collectors: the text format (collectors.text_format, as ``generate_latest`` writes it)
to every scraper that accepts it, Prometheus included; OpenMetrics, by prometheus_client, to one
that asks for OpenMetrics alone; gzip when accepted. Emits ``trainpatrol_collector_success{collector}``
and ``trainpatrol_collector_duration_seconds{collector}``.
"""

from __future__ import annotations

import gzip
import logging
import threading
import time
from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.exposition import CONTENT_TYPE_LATEST, gzip_accepted
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.openmetrics import exposition as openmetrics

from ..catalogue import BY_NAME
from .text_format import text_format

log = logging.getLogger(__name__)
_SUCCESS, _DURATION = "trainpatrol_collector_success", "trainpatrol_collector_duration_seconds"


class Collector(Protocol):
    def version(self) -> Hashable:
        """Changes whenever ``collect`` would give something else. Cheap: asked at every scrape."""

    def collect(self) -> Iterable[Metric]:
        """The collector's families; raises when it has nothing valid to say."""


@dataclass(frozen=True)
class _Part:
    """A collector's last collection: at which version, its families (none when it failed), how it went."""

    version: Hashable
    families: tuple[Metric, ...]
    ok: bool
    seconds: float


def wants_openmetrics(accept: str) -> bool:
    """OpenMetrics only for a scraper that does not take the text format: the text format is written
    in a third of the time (docs/benchmarks.md), and Prometheus takes either."""
    types = {part.split(";")[0].strip().lower() for part in accept.split(",")}
    return "application/openmetrics-text" in types and not types & {"text/plain", "text/*", "*/*"}


@dataclass(frozen=True)
class Body:
    data: bytes
    content_type: str
    gzipped: bool


class Registry:
    """What /metrics serves. Thread-safe: one scrape at a time collects; the others wait for its body."""

    def __init__(self, collectors: Mapping[str, Collector]) -> None:
        self._collectors = dict(collectors)
        self._parts: dict[str, _Part] = {}
        self._logged: set[tuple[str, str]] = set()
        self._bodies: dict[tuple[str, bool], Body] = {}
        self._lock = threading.Lock()

    def body(self, accept: str = "", accept_encoding: str = "") -> Body:
        """The body for a scrape with these ``Accept`` and ``Accept-Encoding`` headers."""
        om = wants_openmetrics(accept)
        content_type = openmetrics.CONTENT_TYPE_LATEST if om else CONTENT_TYPE_LATEST
        gzipped = gzip_accepted(accept_encoding)
        with self._lock:
            if self._refresh():
                self._bodies.clear()
            key = (content_type, gzipped)
            body = self._bodies.get(key)
            if body is None:
                data = openmetrics.generate_latest(self) if om else text_format(self.collect())
                body = self._bodies[key] = Body(gzip.compress(data, 6) if gzipped else data, content_type, gzipped)
            return body

    def collect(self) -> Iterator[Metric]:
        """Every collector's last families, then their health (what prometheus_client's writers read)."""
        for part in self._parts.values():
            yield from part.families
        success = GaugeMetricFamily(_SUCCESS, BY_NAME[_SUCCESS].help, labels=["collector"])
        duration = GaugeMetricFamily(_DURATION, BY_NAME[_DURATION].help, labels=["collector"])
        for name, part in self._parts.items():
            success.add_metric([name], 1.0 if part.ok else 0.0)
            duration.add_metric([name], part.seconds)
        yield success
        yield duration

    def _refresh(self) -> bool:
        """Collects each collector whose version moved; says whether any did."""
        moved = False
        for name, collector in self._collectors.items():
            try:
                version = collector.version()
            except Exception as exc:  # asking must not break the scrape either: collect, and fail there
                self._log(name, exc)
                version = object()
            part = self._parts.get(name)
            if part is None or part.version != version:
                self._parts[name] = self._collect(name, version)
                moved = True
        return moved

    def _collect(self, name: str, version: Hashable) -> _Part:
        start = time.perf_counter()
        try:
            families, ok = tuple(self._collectors[name].collect()), True
        except Exception as exc:  # a broken collector must not break the scrape
            self._log(name, exc)
            families, ok = (), False
        return _Part(version, families, ok, time.perf_counter() - start)

    def _log(self, name: str, exc: Exception) -> None:
        key = (name, f"{type(exc).__name__}: {exc}")
        if key not in self._logged:
            self._logged.add(key)
            log.warning("collector %s failed: %s", name, key[1])
